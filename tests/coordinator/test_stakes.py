"""A node's money through the real API: stake, held pay and the audit window, withdrawals, slashing."""

import json
import re
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest
from typer.testing import CliRunner

from gpuflex.auth.signing import NodeKey, node_id_for
from gpuflex.cli.main import app
from gpuflex.client import Client
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Job
from gpuflex.errors import Conflict, Forbidden, InsufficientFunds, NotFound, Unauthorized
from gpuflex.ledger import accounts
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

from .ledger_checks import sound_totals

WINDOW_S = 15  # node requests carry real time, so the coordinator's clock moves less than their skew


def _job(alice, workers=1):
    spec = JobSpec.model_validate(
        {"name": "t", "resources": {"workers": workers}, "budget": 1.0, "max_price_per_hour": 0.5}
    )
    return alice.submit(spec, alice.upload(b"corpus " * 2000))


@pytest.fixture
def coordinator(coordinator):
    coordinator.ctx.settings.audit_window_s = WINDOW_S
    return coordinator


def _worked_job(coordinator, seconds=20, worker_key=None):
    """Alice's job, run on a core node and one community node for ``seconds``, then cancelled."""
    alice = coordinator.consumer("alice", deposit=10)
    core = coordinator.node("core", core=True, price=0.4)
    worker = coordinator.node("w", price=0.36, key=worker_key)
    job = _job(alice)
    grants = [core.lease(), worker.lease()]
    coordinator.clock.advance(seconds)
    for node, grant in zip((core, worker), grants, strict=True):
        node.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    alice.cancel(job.id)
    return alice, job, core, worker


def _id(node) -> str:
    return node_id_for(node.key.public_key_hex)


def test_pay_is_held_for_the_audit_window_then_released_once(coordinator):
    alice, job, _, worker = _worked_job(coordinator)
    wallet = worker.wallet()
    assert wallet.held == pytest.approx(0.36 * 20 / 3600 * 0.9)  # metered pay less the 10% fee
    assert wallet.earnings == 0
    coordinator.clock.advance(WINDOW_S - 5)
    reap_once(coordinator.ctx)
    assert worker.wallet().earnings == 0  # still inside the window
    coordinator.clock.advance(10)
    reap_once(coordinator.ctx)
    reap_once(coordinator.ctx)  # a second pass (or a second replica) releases nothing more
    after = worker.wallet()
    assert (after.held, after.earnings) == (0, pytest.approx(wallet.held))
    totals = sound_totals(alice)
    assert not any(k.startswith(accounts.HELD) and v for k, v in totals.items())
    payouts = [e for e in alice.ledger().entries if e.kind == "payout"]
    assert len(payouts) == 1 and job.id in payouts[0].memo
    assert any(e.message.startswith("audit window passed: paid") for e in alice.logs(job.id))


def test_a_provider_withdraws_earnings_but_not_more(coordinator):
    alice, _, _, worker = _worked_job(coordinator)
    coordinator.clock.advance(WINDOW_S + 1)
    reap_once(coordinator.ctx)
    earned = worker.wallet().earnings
    with pytest.raises(InsufficientFunds):
        worker.withdraw(earned + 1)
    assert worker.withdraw(earned / 2).earnings == pytest.approx(earned / 2)
    totals = sound_totals(alice)
    assert totals[accounts.provider(_id(worker))] == round(earned * 1e6) - round(earned / 2 * 1e6)


def test_staking_from_outside_and_from_earnings_and_unstaking_when_idle(coordinator):
    alice, _, _, worker = _worked_job(coordinator)
    assert worker.stake(2.0).stake == 2.0
    with pytest.raises(Conflict, match="audit window"):
        worker.unstake(1.0)  # its pay for the job is still held: the stake backs that work
    coordinator.clock.advance(WINDOW_S + 1)
    reap_once(coordinator.ctx)
    earned = worker.wallet().earnings
    wallet = worker.stake(earned, source="earnings")
    assert (wallet.stake, wallet.earnings) == (pytest.approx(2.0 + earned), 0)
    with pytest.raises(InsufficientFunds):
        worker.stake(0.5, source="earnings")
    assert worker.unstake(2.0).earnings == pytest.approx(2.0)
    with pytest.raises(InsufficientFunds):
        worker.unstake(earned + 1)
    sound_totals(alice)


def test_an_unstake_refused_for_the_audit_window_says_when_the_window_ends(coordinator, tmp_path):
    _, job, _, worker = _worked_job(coordinator, worker_key=NodeKey.load_or_create(tmp_path / "node.key"))
    worker.stake(2.0)
    with coordinator.ctx.tx() as s:
        ends = s.get(Job, job.id).finished_at + WINDOW_S
    coordinator.clock.advance(5)
    unstake = ["provider", "unstake", "1", "--data-dir", str(tmp_path), "--url", coordinator.url]
    refused = subprocess.run(
        [sys.executable, "-m", "gpuflex", *unstake], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    at = datetime.fromtimestamp(ends, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert f"held in an audit window until {at} (in " in refused.stderr
    assert re.search(r"\(in \d+ s\): its stake backs that work until then", refused.stderr), refused.stderr


def test_a_node_holding_a_lease_cannot_unstake(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    coordinator.node("core", core=True).lease()
    worker = coordinator.node("w")
    worker.stake(1.0)
    _job(alice)
    assert worker.lease() is not None
    with pytest.raises(Conflict, match="holds a lease"):
        worker.unstake(1.0)


def test_with_a_minimum_stake_only_bonded_community_nodes_get_work(coordinator):
    coordinator.ctx.settings.min_stake = 1.0
    alice = coordinator.consumer("alice", deposit=10)
    core = coordinator.node("core", core=True)
    cheap, bonded = coordinator.node("cheap", price=0.05), coordinator.node("bonded", price=0.3)
    bonded.stake(1.0)
    cheap.stake(0.5)
    job = _job(alice)
    assert core.lease().role == "aggregator"  # core nodes are the operator's: no stake needed
    assert cheap.lease() is None  # the cheapest, but short of the minimum stake
    assert bonded.lease().role == "worker"
    assert {t.node_id for t in alice.job(job.id).tasks} == {_id(core), _id(bonded)}


def test_the_operator_slashes_stake_and_withholds_the_jobs_held_pay(coordinator):
    alice, job, _, worker = _worked_job(coordinator)
    worker.stake(0.5)
    refund_before = alice.balance().balance
    held = worker.wallet().held
    operator = Client(coordinator.url, coordinator.ctx.settings.resolved_operator_token())
    evidence = "trace diverged at step 40"
    verdict = m.SlashRequest(node_id=_id(worker), amount=2.0, evidence=evidence, job_id=job.id)
    record = operator.slash(verdict)
    assert (record.amount, record.withheld) == (0.5, pytest.approx(held))  # it had only 0.5 staked
    wallet = worker.wallet()
    assert (wallet.stake, wallet.held, wallet.slashed) == (0, 0, 0.5)
    assert alice.balance().balance == pytest.approx(refund_before + held)  # the consumer gets it back
    coordinator.clock.advance(WINDOW_S + 1)
    reap_once(coordinator.ctx)
    assert worker.wallet().earnings == 0  # nothing left to release
    assert [s.evidence for s in alice.slashes()] == ["trace diverged at step 40"]
    totals = sound_totals(alice)
    assert totals[accounts.SLASHED] == 500_000
    assert any("withheld" in e.message for e in alice.logs(job.id))


def test_only_the_operator_may_slash_and_bad_verdicts_are_refused(coordinator):
    alice = coordinator.consumer("alice")
    worker = coordinator.node("w")
    verdict = m.SlashRequest(node_id=_id(worker), amount=1.0, evidence="faked work")
    with pytest.raises(Forbidden):
        alice.slash(verdict)
    with pytest.raises(Unauthorized):
        Client(coordinator.url).slash(verdict)
    operator = Client(coordinator.url, coordinator.ctx.settings.resolved_operator_token())
    with pytest.raises(NotFound):
        operator.slash(verdict.model_copy(update={"node_id": "n-nobody"}))
    with pytest.raises(NotFound):
        operator.slash(verdict.model_copy(update={"job_id": "j-nothing"}))
    token = {"Authorization": f"Bearer {coordinator.ctx.settings.resolved_operator_token()}"}
    node_id = _id(worker)
    for body in ({"node_id": node_id, "amount": -1, "evidence": "x"}, {"node_id": node_id, "amount": 1}):
        response = coordinator.http.post("/v1/slashes", json=body, headers=token)
        assert response.status_code == 422 and response.json()["detail"]
    blank = coordinator.http.post(
        "/v1/slashes", json={"node_id": _id(worker), "amount": 1, "evidence": "  "}, headers=token
    )
    assert blank.status_code == 400 and "evidence" in blank.json()["detail"]
    assert alice.slashes() == []


def test_node_money_calls_need_the_nodes_signature(coordinator):
    for path in ("/v1/nodes/stake", "/v1/nodes/withdraw", "/v1/nodes/unstake"):
        response = httpx.post(coordinator.url + path, json={"amount": 1})
        assert response.status_code == 401, path
    assert coordinator.http.get("/v1/nodes/wallet").status_code == 401


def test_the_cli_moves_a_nodes_money_as_the_node_and_slashes_with_the_operators_token(coordinator, tmp_path):
    token = Client(coordinator.url).create_account("alice").token
    key_dir = tmp_path / "agent"
    node = coordinator.node("cli-node", key=NodeKey.load_or_create(key_dir / "node.key"))
    as_node = ["--data-dir", str(key_dir), "--url", coordinator.url]
    runner = CliRunner()

    staked = runner.invoke(app, ["provider", "stake", "3", *as_node])
    assert staked.exit_code == 0, staked.output
    assert "stake 3.000000" in staked.output
    unstaked = runner.invoke(app, ["provider", "unstake", "1", *as_node])
    assert "earnings 1.000000" in unstaked.output and "stake 2.000000" in unstaked.output
    assert "earnings 0.000000" in runner.invoke(app, ["provider", "withdraw", "1", *as_node]).output
    broke = runner.invoke(app, ["provider", "withdraw", "1", *as_node])
    assert broke.exit_code != 0 and "holds 0.000000 credits" in str(broke.exception)

    evidence = ["--evidence", "replayed a stale update"]
    slash = ["operator", "slash", _id(node), "1.5", *evidence, "--url", coordinator.url]
    refused = runner.invoke(app, slash, env={"GPUFLEX_OPERATOR_TOKEN": ""})
    assert refused.exit_code != 0 and "operator token" in str(refused.exception)
    operator_token = coordinator.ctx.settings.resolved_operator_token()
    done = runner.invoke(app, slash, env={"GPUFLEX_OPERATOR_TOKEN": operator_token})
    assert done.exit_code == 0 and "1.500000 credits of stake taken" in done.output
    assert "slashed 1.500000" in runner.invoke(app, ["provider", "wallet", *as_node]).output
    as_alice = ["--url", coordinator.url, "--token", token]
    listed = runner.invoke(app, ["slashes", "--json", *as_alice])  # a table's width is the terminal's
    assert listed.exit_code == 0
    assert "replayed a stale update" in [s["evidence"] for s in json.loads(listed.output)]
