"""Quotes and pricing modes through the real API: nothing is spent on a quote, an auction job's
workers are placed and metered at its clearing price, a fixed job's at each node's own price."""

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from gpuflex.auth.signing import node_id_for
from gpuflex.cli.main import app
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Lease
from gpuflex.errors import BadRequest
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_micro
from gpuflex.protocol.spec import JobSpec


def _spec(**fields) -> JobSpec:
    body = {"name": "t", "resources": {"workers": 2}, "budget": 1.0, "max_price_per_hour": 0.5, **fields}
    return JobSpec.model_validate(body)


def _market(coordinator):
    """A core node for the aggregator and three community nodes asking 0.10, 0.20 and 0.25 credits/h."""
    prices = {"core": 0.3, "c0": 0.1, "c1": 0.2, "c2": 0.25}
    return {name: coordinator.node(name, core=name == "core", price=p) for name, p in prices.items()}


def _id(node) -> str:
    return node_id_for(node.key.public_key_hex)


def _lease_prices(coordinator, job_id) -> dict[str, int]:
    with coordinator.ctx.tx() as s:
        return {
            lease.node_id: lease.price_micro
            for lease in s.scalars(select(Lease).where(Lease.job_id == job_id))
        }


def test_a_quote_names_its_nodes_and_spends_nothing(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    nodes = _market(coordinator)
    q = alice.quote(_spec())
    assert q.placeable and q.pricing == "fixed" and q.clearing_price is None
    assert [(n.role, n.node_id, n.paid) for n in q.nodes] == [
        ("aggregator", _id(nodes["core"]), 0.3),
        ("worker", _id(nodes["c0"]), 0.1),
        ("worker", _id(nodes["c1"]), 0.2),
    ]
    assert 0 < q.duration_low_s < q.duration_s < q.duration_high_s
    assert q.cost == pytest.approx(0.6 * q.duration_s / 3600)
    assert alice.balance().balance == 5 and alice.jobs() == []


def test_an_auction_quote_uses_the_clearing_price(coordinator):
    alice = coordinator.consumer("alice")
    _market(coordinator)
    q = alice.quote(_spec(pricing="auction"))
    assert q.clearing_price == 0.25
    assert [n.paid for n in q.nodes] == [0.3, 0.25, 0.25]


def test_a_quote_that_cannot_be_placed_says_why(coordinator):
    alice = coordinator.consumer("alice")
    coordinator.node("dear", price=0.9)
    q = alice.quote(_spec())
    assert not q.placeable and q.cost is None
    assert q.problems == [
        "no core node can host the aggregator, and 0 of the 2 workers this job needs to start "
        "(resources.min_workers) can be placed now: aggregator: no core node is online; "
        "workers: dear: price 0.90/h > max 0.50/h"
    ]


def test_a_quote_names_each_candidate_node_and_the_real_reason_it_cannot_take_a_task(coordinator, tmp_path):
    coordinator.clock.freeze()  # every node as present as the others: equal uptimes leave price to order them
    alice = coordinator.consumer("alice", deposit=5)
    core, busy = coordinator.node("core-1", core=True, price=0.3), coordinator.node("c-busy", price=0.1)
    first = alice.submit(_spec(resources={"workers": 1}), alice.upload(b"corpus " * 2000))
    assert core.lease().role == "aggregator" and busy.lease().role == "worker"
    for name, price in (("c0", 0.11), ("c1", 0.12)):
        coordinator.node(name, price=price)
    # the only core node is busy: neither the price cap nor the region is the reason
    why = "no core node can host the aggregator: core-1: busy (aggregator, leased)"
    assert alice.quote(_spec()).problems == [why]
    bob = coordinator.consumer("bob", deposit=5)
    assert first.id not in " ".join(bob.quote(_spec()).problems)  # busy says with what, never whose job
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: t\nresources: {workers: 2}\nmax_price_per_hour: 0.5\n")
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    flags = ["--url", coordinator.url, "--token", token]
    result = CliRunner().invoke(app, ["quote", str(spec_file), *flags])
    assert result.exit_code == 1 and why in " ".join(result.output.split()), result.output
    # workers too, each candidate with its first reason: busy, stake, region, price
    coordinator.ctx.settings.min_stake = 1.0
    busy.stake(1.0)
    coordinator.node("c-far", price=0.13, region="far").stake(1.0)
    coordinator.node("c-dear", price=0.9).stake(1.0)
    q = alice.quote(_spec(resources={"workers": 2, "region": "local"}))
    assert q.problems == [
        "no core node can host the aggregator, and 0 of the 2 workers this job needs to start "
        f"(resources.min_workers) can be placed now: aggregator: {why.split(': ', 1)[1]}; workers: "
        f"c-busy: busy (worker, leased), c0: stake 0 < min_stake 1 credits, "
        "c1: stake 0 < min_stake 1 credits, c-far: region far != local, "
        f"core-1: busy (aggregator, leased), c-dear: price 0.90/h > max 0.50/h"
    ]


def test_bad_quote_requests_are_4xx_with_a_message(coordinator):
    alice = coordinator.consumer("alice")
    auth = alice.http._http.headers
    good = _spec().model_dump(mode="json")
    response = coordinator.http.post("/v1/quote", json={**good, "pricing": "dutch"}, headers=auth)
    assert response.status_code == 422 and "pricing" in response.json()["detail"]
    response = coordinator.http.post("/v1/quote", json={**good, "colour": "red"}, headers=auth)
    assert response.status_code == 422 and response.json()["detail"] == "colour: unknown field"
    assert coordinator.http.post("/v1/quote", json=good).status_code == 401
    user = _spec(training={"recipe": "user", "recipe_file": "r.py"})
    with pytest.raises(BadRequest, match=r"set training\.round_seconds"):
        alice.quote(user)


def test_auction_workers_are_paid_the_clearing_price_and_the_aggregator_its_own(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    nodes = _market(coordinator)
    job = alice.submit(_spec(pricing="auction"), alice.upload(b"corpus " * 2000))
    grants = {name: node.lease() for name, node in nodes.items()}
    assert grants["core"].role == "aggregator" and grants["c2"] is None  # c2's ask set the price
    detail = alice.job(job.id)
    assert detail.clearing_price == 0.25 and detail.spec.pricing == "auction"
    reasons = {t.node_id: t.placement for t in detail.tasks if t.role == "worker"}
    assert reasons[_id(nodes["c0"])] == (
        "won the auction at ask 0.100, clearing price 0.250 credits/h (2 lowest of 3 eligible asks)"
    )
    assert _lease_prices(coordinator, job.id) == {
        _id(nodes["core"]): to_micro(0.3),
        _id(nodes["c0"]): to_micro(0.25),
        _id(nodes["c1"]): to_micro(0.25),
    }


def test_an_auction_replacement_asks_at_most_the_clearing_price_and_is_paid_it(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    nodes = _market(coordinator)
    job = alice.submit(_spec(pricing="auction"), alice.upload(b"corpus " * 2000))
    grants = {name: nodes[name].lease() for name in ("core", "c0", "c1")}
    dear = coordinator.node("dear", price=0.4, tflops=100)  # best by cost per TFLOP, but asks too much
    gone = grants["c1"]
    nodes["c1"].report(gone.lease_id, m.LeaseReport(epoch=gone.epoch, outcome="released"))
    reap_once(coordinator.ctx)
    task = next(t for t in alice.job(job.id).tasks if t.id == gone.task_id)
    assert task.node_id == _id(nodes["c1"]) and task.node_id != _id(dear)
    assert task.placement.startswith(
        "replacement paid the auction's clearing price 0.250 credits/h; rank 1 of"
    )
    assert nodes["c1"].lease().task_id == gone.task_id
    with coordinator.ctx.tx() as s:
        prices = s.scalars(select(Lease.price_micro).where(Lease.task_id == gone.task_id)).all()
    assert prices == [to_micro(0.25), to_micro(0.25)]


def test_a_fixed_job_pays_each_node_its_own_price(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    nodes = _market(coordinator)
    job = alice.submit(_spec(), alice.upload(b"corpus " * 2000))
    for node in nodes.values():
        node.lease()
    assert alice.job(job.id).clearing_price is None
    assert _lease_prices(coordinator, job.id) == {
        _id(nodes["core"]): to_micro(0.3),
        _id(nodes["c0"]): to_micro(0.1),
        _id(nodes["c1"]): to_micro(0.2),
    }


def test_the_cli_prints_a_quote_and_a_jobs_pricing(coordinator, tmp_path):
    token = (
        coordinator.consumer("alice", deposit=5).http._http.headers["Authorization"].removeprefix("Bearer ")
    )
    _market(coordinator)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: t\nresources: {workers: 2}\npricing: auction\nmax_price_per_hour: 0.5\n")
    flags = ["--url", coordinator.url, "--token", token]
    result = CliRunner().invoke(app, ["quote", str(spec_file), *flags], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "assumed nodes" in result.output and "c0" in result.output and "duration ≈" in result.output
    assert "every worker paid the clearing price 0.250 credits/h" in result.output
    assert "shirking" not in result.output  # audited at 0.05 with a 1-credit slash: deterred
    unaudited = tmp_path / "unaudited.yaml"
    unaudited.write_text("name: t\nresources: {workers: 2}\ntraining: {verification: {audit_rate: 0}}\n")
    result = CliRunner().invoke(app, ["quote", str(unaudited), *flags], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "shirking pays in expectation in the first 8 rounds" in result.output
    assert "nothing is audited" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\npricing: dutch\n")
    failed = CliRunner().invoke(app, ["quote", str(bad), *flags])
    assert failed.exit_code != 0 and "pricing" in str(failed.exception)


def _run_to_completion(coordinator, alice, nodes, *, start_s: float, round_s: float, rounds: int = 2):
    """One job of ``rounds`` rounds through the real API on a frozen clock: round 0 ``start_s`` after
    submission, each trained round ``round_s`` after the last."""
    job = alice.submit(_spec(training={"rounds": rounds}), alice.upload(b"corpus " * 2000))
    grants = [node.lease() for node in nodes.values()]
    (agg,) = (coordinator.task(g) for g in grants if g.role == "aggregator")
    workers = [coordinator.task(g) for g in grants if g.role == "worker"]
    coordinator.clock.advance(start_s)
    agg.publish_round(m.RoundPublish(round=0, state_hash="ab" * 32, checkpoint=agg.put_blob(b"s0")))
    for r in range(rounds):
        coordinator.clock.advance(round_s)
        for node in nodes.values():
            node.heartbeat([])
        for i, w in enumerate(workers):
            w.submit_contribution(
                m.ContributionSubmit(
                    round=r, delta=w.put_blob(b"d%d%d" % (r, i)), tokens=1, steps=1, train_loss=1
                )
            )
        last = r == rounds - 1
        agg.publish_round(
            m.RoundPublish(
                round=r + 1,
                state_hash="ab" * 32,
                update=agg.put_blob(b"u%d" % r),
                checkpoint=agg.put_blob(b"s%d" % r) if last else None,
                contributions=len(workers),
            )
        )
    assert alice.job(job.id).state == "completed"


def test_quotes_are_calibrated_on_what_the_networks_completed_jobs_took(coordinator):
    coordinator.clock.freeze()  # each job takes exactly the seconds it is told to
    alice = coordinator.consumer("alice", deposit=10)
    nodes = {
        n: coordinator.node(n, core=n == "core", price=p)
        for n, p in (("core", 0.3), ("c0", 0.1), ("c1", 0.2))
    }
    before = alice.quote(_spec(training={"rounds": 10}))
    assert any("not yet calibrated" in a for a in before.assumptions)
    # three jobs that started in 1, 2 and 3 s and ran rounds of 5 s (the model says far less on these nodes);
    # 36 s of advance in all: a node signs its requests on its own clock, within 60 s of the coordinator's
    for start_s in (1.0, 2.0, 3.0):
        _run_to_completion(coordinator, alice, nodes, start_s=start_s, round_s=5.0)
    after = alice.quote(_spec(training={"rounds": 10}))
    assert any("calibrated on the network's last 3 jobs: ≈ 2 s" in a for a in after.assumptions), after
    # the same nodes: rounds take what they took, after the median start
    assert after.duration_s == pytest.approx(2.0 + 10 * 5.0, rel=0.01)
    assert after.duration_low_s < 51 < 53 < after.duration_high_s  # the spread of 11, 12 and 13 s jobs
    assert after.duration_high_s / after.duration_low_s < before.duration_high_s / before.duration_low_s
