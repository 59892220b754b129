"""HTTPS end to end: a coordinator serving a certificate of a private CA (``--tls-cert``/``--tls-key``),
agents and their task subprocesses and the CLI verifying it with ``--ca``; a client trusting another CA,
or only the system's, is refused with one line that says what to pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
import yaml

from gpuflex.client import Client
from gpuflex.errors import ServiceError
from gpuflex.localnet import LocalNetwork, Tls
from gpuflex.testing import small_job, write_corpus


def _pem(path, blob) -> Path:
    blob.write_to_path(str(path))
    return path


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> Tls:
    root = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    return Tls(
        cert=_pem(root / "server.pem", cert.private_key_and_cert_chain_pem),
        key=_pem(root / "server.key", cert.private_key_pem),
        ca=_pem(root / "ca.pem", ca.cert_pem),
    )


@pytest.fixture
def network(tmp_path, tls):
    with LocalNetwork(tmp_path / "net", tls=tls) as net:
        net.start_coordinator()
        yield net


def gpuflex(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "COLUMNS": "200"}
    for name in ("GPUFLEX_URL", "GPUFLEX_TOKEN", "GPUFLEX_CA", "GPUFLEX_PROFILE"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_user_submits_over_https_and_agents_and_tasks_verify_the_coordinator(network, tmp_path):
    """The whole path a user takes: the CA given once, at sign-up, is saved with the profile; the job's
    workers and aggregator (task subprocesses, confined to their directories) reach the coordinator too."""
    assert network.url.startswith("https://")
    network.start_agent("core-1", price=0.4, core=True)
    network.start_agent("box-1", price=0.2)
    write_corpus(tmp_path / "data")
    created = gpuflex(
        tmp_path, "--ca", str(network.tls.ca), "account", "create", "alice", "--url", network.url
    )
    assert created.returncode == 0, created.stderr
    assert gpuflex(tmp_path, "wallet", "deposit", "5").returncode == 0  # no --ca: the profile's
    assert f"(verified with the CA in {network.tls.ca})" in gpuflex(tmp_path, "whoami").stdout
    spec = small_job(tmp_path / "data", workers=1, rounds=2).model_dump(mode="json", exclude_none=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    watched = gpuflex(tmp_path, "submit", str(tmp_path / "job.yaml"), "--watch")
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "completed; round 2/2" in watched.stdout, watched.stdout


def test_a_client_trusting_another_ca_or_the_systems_is_refused_with_what_to_pass(network, tmp_path):
    other = _pem(tmp_path / "other.pem", trustme.CA().cert_pem)
    for trust in (["--ca", other], []):
        refused = gpuflex(tmp_path, *trust, "offers", "--url", network.url)
        assert refused.returncode == 1, refused.stdout
        assert "TLS certificate is not trusted" in refused.stderr and "--ca FILE" in refused.stderr, (
            refused.stderr
        )
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    with pytest.raises(ServiceError, match="not trusted"):
        Client(network.url, ca=other).offers()


def test_plain_http_to_the_https_port_gets_no_answer(network):
    with pytest.raises(ServiceError, match="cannot reach"):
        Client(network.url.replace("https://", "http://")).offers()


def test_a_certificate_without_its_key_or_a_missing_file_is_one_line(tmp_path, tls):
    alone = gpuflex(
        tmp_path, "coordinator", "serve", "--tls-cert", str(tls.cert), "--data-dir", str(tmp_path)
    )
    assert alone.returncode == 1 and "--tls-cert and --tls-key go together" in alone.stderr, alone.stderr
    missing = gpuflex(
        tmp_path, "coordinator", "serve", "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tls.key)
    )
    assert missing.returncode == 1 and f"--tls-cert {tmp_path / 'nope.pem'}: no such file" in missing.stderr
