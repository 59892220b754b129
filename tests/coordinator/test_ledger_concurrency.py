"""Concurrent clients cannot double-spend: many submissions at once against one wallet on
PostgreSQL (where replicas share a database) take exactly what the wallet holds, never more."""

import threading

import pytest

from gpuflex.client import Client
from gpuflex.errors import InsufficientFunds
from gpuflex.ledger.export import verify_export
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import check_invariants

AFFORDABLE, ATTEMPTS = 3, 10  # the wallet pays for exactly AFFORDABLE jobs of 1 credit


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_concurrent_submissions_cannot_double_spend(coordinator):
    token = Client(coordinator.url).create_account("alice").token
    alice = Client(coordinator.url, token)
    alice.deposit(AFFORDABLE)
    dataset = alice.upload(b"x" * 1000)
    clients = [Client(coordinator.url, token) for _ in range(ATTEMPTS)]
    start = threading.Barrier(ATTEMPTS)
    outcomes: list[str] = []

    def submit(i: int) -> None:
        start.wait()
        try:
            clients[i].submit(JobSpec(name=f"job-{i}", budget=1), dataset)
            outcomes.append("submitted")
        except InsufficientFunds:
            outcomes.append("402")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(ATTEMPTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert sorted(outcomes) == ["402"] * (ATTEMPTS - AFFORDABLE) + ["submitted"] * AFFORDABLE
    assert alice.balance().balance == 0
    assert len(alice.jobs()) == AFFORDABLE
    key = coordinator.ctx.ledger_key.public_key_hex
    export = alice.ledger()
    report = verify_export(export, public_key=key)  # also: no balance ever went negative
    assert report.ok, report.problem
    assert [e.kind for e in export.entries].count("escrow") == AFFORDABLE
    assert check_invariants(coordinator.ctx.settings.database_url, ledger_public_key=key) == []
    for client in clients:
        client.close()
