"""A new user's first commands, run as processes against a real coordinator: accounts and the profiles
that keep their tokens, ``whoami``, an empty token, a deposit out of range, a budget beyond the wallet,
a wrong URL, and the operator's token on disk once the coordinator serves. Each test has its own HOME, so
the profile file is its own."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpuflex.client import Client
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.localnet import free_port
from gpuflex.testing import serve, wait_for


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    data_dir = tmp_path_factory.mktemp("coordinator")
    database_url = f"sqlite:///{data_dir / 'gpuflex.db'}"
    upgrade(database_url)
    settings = CoordinatorSettings(data_dir=data_dir, database_url=database_url, reaper_interval_s=3600)
    with serve(create_app(settings)) as url:
        yield url


def gpuflex(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", *args],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(home), "COLUMNS": "200", **env},
        timeout=60,
    )


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error a command failed with: exit 1 and one line on stderr, never a traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def saved(home: Path) -> dict:
    return json.loads((home / ".gpuflex" / "client.json").read_text())


def test_a_second_account_is_saved_beside_the_first_never_over_it(url, tmp_path):
    first = ok(gpuflex(tmp_path, "account", "create", "p-alice", "--url", url))
    assert "saved as profile p-alice" in first and "the default one" in first
    second = ok(gpuflex(tmp_path, "account", "create", "p-bob", "--url", url))
    assert "saved as profile p-bob" in second
    assert "gpuflex --profile p-bob COMMAND" in second and "gpuflex account use p-bob" in second
    profiles = saved(tmp_path)
    assert profiles["default"] == "p-alice" and set(profiles["profiles"]) == {"p-alice", "p-bob"}
    assert stat.S_IMODE((tmp_path / ".gpuflex" / "client.json").stat().st_mode) == 0o600

    alice = ok(gpuflex(tmp_path, "whoami"))
    assert "account: p-alice (a-" in alice and f"coordinator: {url}" in alice
    assert "profile: p-alice (the default)" in alice and "balance: 0.00 credits" in alice
    assert "account: p-bob" in ok(gpuflex(tmp_path, "--profile", "p-bob", "whoami"))
    assert "profile: p-bob (GPUFLEX_PROFILE)" in ok(gpuflex(tmp_path, "whoami", GPUFLEX_PROFILE="p-bob"))

    ok(gpuflex(tmp_path, "account", "use", "p-bob"))
    assert "profile: p-bob (the default)" in ok(gpuflex(tmp_path, "whoami"))
    alice_token = profiles["profiles"]["p-alice"]["token"]
    # flags, then GPUFLEX_TOKEN, then the chosen profile
    assert "account: p-alice" in ok(gpuflex(tmp_path, "whoami", GPUFLEX_TOKEN=alice_token))
    bob_token = profiles["profiles"]["p-bob"]["token"]
    by_flag = gpuflex(tmp_path, "whoami", "--token", bob_token, GPUFLEX_TOKEN=alice_token)
    assert "account: p-bob" in ok(by_flag)


def test_a_saved_profile_is_replaced_only_with_force(url, tmp_path):
    ok(gpuflex(tmp_path, "account", "create", "f-carol", "--url", url))
    kept = saved(tmp_path)
    again = one_line_error(gpuflex(tmp_path, "account", "create", "f-carol"))
    assert "a profile named 'f-carol' is saved already" in again and "--force" in again
    assert saved(tmp_path) == kept

    # Refused before the account is made: the name is still free on the coordinator.
    profiles = saved(tmp_path)
    profiles["profiles"]["f-dave"] = {"url": url, "token": "gfx_lost"}
    (tmp_path / ".gpuflex" / "client.json").write_text(json.dumps(profiles))
    assert "saved already" in one_line_error(gpuflex(tmp_path, "account", "create", "f-dave"))
    ok(gpuflex(tmp_path, "account", "create", "f-dave", "--force"))
    replaced = saved(tmp_path)
    assert replaced["profiles"]["f-dave"]["token"] != "gfx_lost"
    assert replaced["profiles"]["f-carol"] == kept["profiles"]["f-carol"]

    (tmp_path / ".gpuflex" / "client.json").write_text("not json")
    broken = one_line_error(gpuflex(tmp_path, "account", "create", "f-erin"))
    assert "is not a profile file" in broken and "--force" in broken
    assert (tmp_path / ".gpuflex" / "client.json").read_text() == "not json"


def test_the_file_of_older_versions_reads_as_a_profile_and_is_kept(url, tmp_path):
    token = Client(url).create_account("l-old").token
    (tmp_path / ".gpuflex").mkdir()
    (tmp_path / ".gpuflex" / "client.json").write_text(json.dumps({"url": url, "token": token}))
    assert "profile: default (the default)" in ok(gpuflex(tmp_path, "whoami"))
    ok(gpuflex(tmp_path, "account", "create", "l-new"))
    profiles = saved(tmp_path)
    assert profiles["default"] == "default" and profiles["profiles"]["default"]["token"] == token
    assert set(profiles["profiles"]) == {"default", "l-new"}


def test_profiles_are_listed_without_their_tokens_and_an_unknown_one_is_named(url, tmp_path):
    ok(gpuflex(tmp_path, "account", "create", "u-gina", "--url", url))
    ok(gpuflex(tmp_path, "account", "create", "u-hal"))
    tokens = [p["token"] for p in saved(tmp_path)["profiles"].values()]
    listing = ok(gpuflex(tmp_path, "account", "profiles"))
    as_json = json.loads(ok(gpuflex(tmp_path, "account", "profiles", "--json")))
    assert not any(token in listing or token in json.dumps(as_json) for token in tokens)
    assert [(p["profile"], p["default"]) for p in as_json] == [("u-gina", True), ("u-hal", False)]
    marked = {line.split("│")[2].strip(): "*" in line for line in listing.splitlines() if "u-" in line}
    assert marked == {"u-gina": True, "u-hal": False}

    for result in (
        gpuflex(tmp_path, "--profile", "nobody", "jobs"),
        gpuflex(tmp_path, "jobs", GPUFLEX_PROFILE="nobody"),
        gpuflex(tmp_path, "account", "use", "nobody"),
    ):
        assert "no profile 'nobody'" in one_line_error(result) and "u-gina, u-hal" in result.stderr


def test_an_empty_token_or_url_is_refused_not_replaced_by_the_saved_one(url, tmp_path):
    ok(gpuflex(tmp_path, "account", "create", "e-kim", "--url", url))
    assert one_line_error(gpuflex(tmp_path, "jobs", "--token", "")) == "error: --token is empty"
    assert one_line_error(gpuflex(tmp_path, "jobs", "--url", "")) == "error: --url is empty"
    assert one_line_error(gpuflex(tmp_path, "--profile", "", "jobs")) == "error: --profile is empty"


def test_a_deposit_out_of_range_is_one_line_naming_the_range(url, tmp_path):
    ok(gpuflex(tmp_path, "account", "create", "d-ivy", "--url", url))
    for amount in ("0", "-5", "2000000", "nan"):
        refused = one_line_error(gpuflex(tmp_path, "wallet", "deposit", amount))
        assert "a deposit must be 0.000001 to 1000000.00 credits" in refused, refused
    assert "balance: 2.50 credits" in ok(gpuflex(tmp_path, "wallet", "deposit", "2.5"))

    token = saved(tmp_path)["profiles"]["d-ivy"]["token"]
    for amount in (0, -5, 2_000_000):
        answer = httpx.post(
            f"{url}/v1/wallet/deposit", json={"amount": amount}, headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 422 and answer.json()["detail"].startswith("amount: ")


def test_a_budget_beyond_the_wallet_is_said_in_the_users_words(url, tmp_path):
    ok(gpuflex(tmp_path, "account", "create", "b-jack", "--url", url))
    ok(gpuflex(tmp_path, "wallet", "deposit", "8"))
    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\ntraining: {recipe: mlp-digits}\ndata: {source: none}\nbudget: 500\n")

    quoted = gpuflex(tmp_path, "quote", str(spec))
    warning = " ".join(quoted.stdout.split())
    assert (
        "your wallet holds 8.00 credits and this job's budget is 500.00: submit would be refused" in warning
    )
    assert "`gpuflex wallet deposit 492.00`" in warning

    refused = one_line_error(gpuflex(tmp_path, "submit", str(spec)))
    assert "your wallet holds 8.00 credits and this job's budget is 500.00: add 492.00 with " in refused
    assert "`gpuflex wallet deposit 492.00`" in refused and "consumer:" not in refused


def test_a_wrong_url_path_names_the_url_a_missing_job_does_not(url, tmp_path):
    token = Client(url).create_account("w-lou").token
    wrong = one_line_error(gpuflex(tmp_path, "jobs", "--url", f"{url}/wrong", "--token", token))
    assert f"nothing at GET {url}/wrong/v1/jobs: is the coordinator URL right? (HTTP 404)" in wrong
    missing = one_line_error(gpuflex(tmp_path, "job", "show", "j-nope", "--url", url, "--token", token))
    assert "no job j-nope (HTTP 404)" in missing and "nothing at" not in missing


def test_the_operator_token_is_on_disk_once_the_coordinator_serves(tmp_path):
    data_dir, port = tmp_path / "coordinator", free_port()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "COLUMNS": "300"}
    command = [sys.executable, "-m", "gpuflex", "coordinator", "serve", "--data-dir", str(data_dir)]
    with subprocess.Popen([*command, "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True) as p:
        try:
            wait_for(lambda: _answers(f"http://127.0.0.1:{port}"), 60, "the coordinator to serve")
            token = data_dir / "operator_token"
            assert token.read_text().startswith("gfxop_")
            assert stat.S_IMODE(token.stat().st_mode) == 0o600
        finally:
            p.terminate()
        said = "".join(p.stderr.read().split())  # the log's lines fold where a long path would overrun
        assert f"operatortokenin{token}" in said


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/docs").status_code == 200
    except httpx.TransportError:
        return False
