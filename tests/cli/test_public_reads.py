"""Anyone can audit: with no token anywhere (an empty HOME), the real CLI reads the network's public
record from a real coordinator — the journal, verdicts, governance and offers — as tables that keep
ids whole at 80 columns, or as JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib.resources import files

import pytest

from gpuflex.auth.signing import NodeKey, node_id_for
from gpuflex.client import Client, NodeClient
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol import messages as m
from gpuflex.testing import register_node, serve

CORE_TOKEN = "core-secret"
EXAMPLE = files("gpuflex.examples") / "char-gpt.yaml"


@dataclass
class Network:
    url: str
    nodes: dict[str, str]  # name -> node id
    proposal_id: str
    evidence: str


def _node(url: str, name: str, *, core: bool = False, gpu: m.GpuInfo | None = None) -> NodeClient:
    return register_node(
        url,
        name,
        core_token=CORE_TOKEN if core else None,
        price=0.4 if core else 0.2,
        tflops=82.6 if gpu else 1.5,
        region="eu",
        gpu=gpu,
        available_hours=None if core else 48,
    )


@pytest.fixture(scope="module")
def network(tmp_path_factory) -> Iterator[Network]:
    """A coordinator with a core node, two community nodes (one with a GPU), a proposal and a verdict."""
    data_dir = tmp_path_factory.mktemp("coordinator")
    database_url = f"sqlite:///{data_dir / 'gpuflex.db'}"
    upgrade(database_url)
    settings = CoordinatorSettings(
        data_dir=data_dir, database_url=database_url, core_token=CORE_TOKEN, reaper_interval_s=3600
    )
    with serve(create_app(settings)) as url:
        rtx = m.GpuInfo(name="NVIDIA GeForce RTX 4090", vram_gb=24)
        nodes = {"core-1": _node(url, "core-1", core=True), "box-1": _node(url, "box-1", gpu=rtx)}
        nodes["box-2"] = _node(url, "box-2")
        nodes["box-1"].stake(settings.governance_proposal_stake)
        nodes["box-2"].stake(2)
        effective_at = datetime.now(UTC) + timedelta(seconds=settings.governance_voting_period_s + 3600)
        proposal = nodes["box-1"].propose(
            m.ProposalCreate(
                parameter="audit_rate", value=0.1, effective_at=effective_at, reason="audit more"
            )
        )
        ids = {name: node_id_for(node.key.public_key_hex) for name, node in nodes.items()}
        evidence = "replayed a stale update in round 3 and sent it again as new work"
        operator = Client(url, settings.resolved_operator_token())
        operator.slash(m.SlashRequest(node_id=ids["box-2"], amount=1, evidence=evidence))
        yield Network(url, ids, proposal.id, evidence)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")  # no ~/.gpuflex/client.json: no token saved anywhere


def _gpuflex(home, *args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    env.update(HOME=str(home), COLUMNS=str(columns))
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", *args], capture_output=True, text=True, env=env, timeout=60
    )


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


def test_anyone_audits_the_journal_with_no_token(network, home, tmp_path):
    live = _gpuflex(home, "ledger", "verify", "--from", network.url)
    assert live.returncode == 0, live.stderr
    assert "chain verified" in live.stdout
    exported = tmp_path / "ledger.json"
    assert _gpuflex(home, "ledger", "export", "-o", str(exported), "--url", network.url).returncode == 0
    key = json.loads(exported.read_text())["public_key"]
    pinned = _gpuflex(home, "ledger", "verify", "--from", str(exported), "--public-key", key)
    assert pinned.returncode == 0 and f"chain verified, signed by key {key}" in pinned.stdout
    # what stays a consumer's own still needs its token
    quote = _gpuflex(home, "quote", str(EXAMPLE), "--url", network.url)
    assert "no API token" in _one_line_error(quote)


def test_a_bad_or_foreign_public_key_is_named_as_such_not_as_a_broken_chain(network, home):
    verify = ("ledger", "verify", "--from", network.url, "--public-key")
    malformed = _one_line_error(_gpuflex(home, *verify, "00"))
    assert malformed == "error: '00' is not an Ed25519 public key: a key is 64 hex digits"

    signer, stranger = Client(network.url).ledger().public_key, NodeKey.generate().public_key_hex
    mismatch = _one_line_error(_gpuflex(home, *verify, stranger))
    assert mismatch == (
        f"error: key mismatch: the export is signed by key {signer}, not by the key you trust ({stranger}); "
        "its entries were not checked"
    )


def test_verdicts_governance_and_offers_need_no_token_and_fit_80_columns(network, home):
    listings = {
        "slashes": ([network.nodes["box-2"], *network.evidence.split()], ["slashes"]),
        "proposals": (
            [network.proposal_id, network.nodes["box-1"], "audit_rate = 0.1"],
            ["governance", "proposals"],
        ),
        "parameters": (
            ["platform_fee_bps", "heartbeat_interval_s", "1000 bps"],
            ["governance", "parameters"],
        ),
        "offers": ([*network.nodes.values(), "(community)", "reliable", "TFLOPS"], ["offers"]),
    }
    for name, (whole, args) in listings.items():
        result = _gpuflex(home, *args, "--url", network.url)
        assert result.returncode == 0, f"{name}: {result.stderr}"
        lines = result.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, f"{name}:\n{result.stdout}"
        for text in whole:  # ids, and every word, on one line: wrapped between words, never inside one
            assert any(text in line for line in lines), f"{name}: {text!r} cut in\n{result.stdout}"


def test_listings_print_json_for_scripts(network, home):
    anyone = Client(network.url)
    expected = {
        ("slashes",): [s.model_dump(mode="json") for s in anyone.slashes()],
        ("governance", "proposals"): [p.model_dump(mode="json") for p in anyone.proposals()],
        ("governance", "parameters"): [p.model_dump(mode="json") for p in anyone.parameters()],
    }
    for args, records in expected.items():
        result = _gpuflex(home, *args, "--json", "--url", network.url)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == records, args
    offers = _gpuflex(home, "offers", "kind=community", "--order", "name", "--json", "--url", network.url)
    assert offers.returncode == 0, offers.stderr
    listed = [m.Offer.model_validate(o) for o in json.loads(offers.stdout)]
    assert [(o.name, o.node_id) for o in listed] == [(n, network.nodes[n]) for n in ("box-1", "box-2")]
    assert listed[0].gpu == "NVIDIA GeForce RTX 4090" and listed[0].hours == pytest.approx(48, abs=0.1)
