"""The journal is signed by the coordinator: a row changed in the database, even re-hashed and
relinked consistently, fails verification through the export API and ``gpuflex ledger verify --from
URL``, naming the first bad entry."""

import stat
import subprocess
import sys

import pytest
from pydantic import ValidationError
from sqlalchemy import select

from gpuflex.client import Client
from gpuflex.coordinator.db import JournalEntry
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.ledger.export import verify_export
from gpuflex.ledger.journal import make_entry
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import check_invariants


def _a_few_entries(coordinator) -> str:
    """Deposits and a job's escrow (entries 1..4); the API token of the consumer who made them."""
    token = Client(coordinator.url).create_account("alice").token
    alice = Client(coordinator.url, token)
    alice.deposit(5)
    alice.submit(JobSpec(name="j", budget=2), alice.upload(b"x" * 1000))
    alice.deposit(1)
    coordinator.consumer("bob", deposit=3)
    return token


def _verify_cli(coordinator, token: str, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "gpuflex",
        "ledger",
        "verify",
        "--from",
        coordinator.url,
        "--token",
        token,
    ]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)


def _broken(coordinator, token: str, problem: str) -> None:
    """The export, the CLI and check_invariants all refuse the journal and name ``problem``."""
    report = verify_export(Client(coordinator.url, token).ledger())
    assert not report.ok and report.problem.startswith(problem), report.problem
    cli = _verify_cli(coordinator, token)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and problem in cli.stderr, cli.stderr
    key = coordinator.ctx.ledger_key.public_key_hex
    database = coordinator.ctx.settings.database_url
    assert any(problem in p for p in check_invariants(database, ledger_public_key=key))


def test_the_export_is_signed_by_the_coordinators_key(coordinator):
    token = _a_few_entries(coordinator)
    export = Client(coordinator.url, token).ledger()
    key = coordinator.ctx.ledger_key.public_key_hex
    assert export.public_key == key and len(export.entries) == 4
    assert all(len(e.signature) == 128 for e in export.entries)
    report = verify_export(export, public_key=key)
    assert report.ok and report.public_key == key, report.problem
    cli = _verify_cli(coordinator, token, "--public-key", key)
    assert cli.returncode == 0 and f"4 entries, chain verified, signed by key {key}" in cli.stdout
    assert check_invariants(coordinator.ctx.settings.database_url, ledger_public_key=key) == []
    stranger = "ab" * 32
    cli = _verify_cli(coordinator, token, "--public-key", stranger)
    assert cli.returncode == 1 and f"not by the key you trust ({stranger})" in cli.stderr


@pytest.mark.parametrize("column", ["postings", "memo"])
def test_a_row_changed_in_the_database_fails_and_names_it(coordinator, column):
    token = _a_few_entries(coordinator)
    with coordinator.ctx.tx() as s:
        row = s.get(JournalEntry, 2)
        if column == "postings":
            row.postings = [[account, amount * 2] for account, amount in row.postings]
        else:
            row.memo = "nothing to see here"
    _broken(coordinator, token, "seq 2: hash mismatch")


def test_a_journal_rehashed_and_relinked_by_an_attacker_fails_on_its_signature(coordinator):
    token = _a_few_entries(coordinator)
    with coordinator.ctx.tx() as s:
        rows = list(s.scalars(select(JournalEntry).order_by(JournalEntry.seq)))
        prev = None
        for row in rows:
            memo = "deposit by mallory" if row.seq == 2 else row.memo
            postings = [tuple(p) for p in row.postings]
            prev = make_entry(prev, at=row.at, kind=row.kind, memo=memo, postings=postings)
            row.memo, row.prev_hash, row.hash = prev.memo, prev.prev_hash, prev.hash
    _broken(coordinator, token, "seq 2: signature does not verify")


def test_the_ledger_key_is_made_once_in_data_dir_or_shared_by_a_setting(tmp_path):
    made = CoordinatorSettings(data_dir=tmp_path / "a").resolved_ledger_key().public_key_hex
    path = tmp_path / "a" / "ledger_key.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert CoordinatorSettings(data_dir=tmp_path / "a").resolved_ledger_key().public_key_hex == made
    shared = "5e" * 32  # replicas on one database are given the same key
    replicas = [CoordinatorSettings(data_dir=tmp_path / r, ledger_key=shared) for r in ("b", "c")]
    assert len({r.resolved_ledger_key().public_key_hex for r in replicas}) == 1
    assert made != replicas[0].resolved_ledger_key().public_key_hex
    assert not (tmp_path / "b" / "ledger_key.pem").exists()
    with pytest.raises(ValidationError, match=r"ledger_key\n.*64 hex digits"):
        CoordinatorSettings(data_dir=tmp_path, ledger_key="not a key")
