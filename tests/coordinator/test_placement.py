"""Placement through the real API: a job starts only with its min_workers placed, a job's core quota,
forbidden fallback, the default, and why each waiting task waits."""

import re

import pytest
from sqlalchemy import text

from gpuflex.auth.signing import node_id_for
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.services import market
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import check_invariants, scratch_postgres_database

from .conftest import running_coordinator

WAITS = "worker 1 waits: no eligible community node is free and the job forbids core fallback: "


def _network(coordinator, community=1, spare=True, **resources):
    """Two free core nodes (the cheaper one takes the aggregator; ``spare``: the other), cheap community
    nodes, one job."""
    alice = coordinator.consumer("alice", deposit=10)
    nodes = {
        "core-agg": coordinator.node("core-agg", core=True, price=0.3),
        **({"core-spare": coordinator.node("core-spare", core=True, price=0.4)} if spare else {}),
        **{f"c{i}": coordinator.node(f"c{i}", price=0.1 + i / 100) for i in range(community)},
    }
    spec = JobSpec.model_validate(
        {"name": "t", "resources": {"workers": 2, **resources}, "budget": 1.0, "max_price_per_hour": 0.5}
    )
    job = alice.submit(spec, alice.upload(b"corpus " * 2000))
    return alice, nodes, job


def _placed(alice, job, nodes):
    """Each task as (role, index) -> (name of the node it is placed on, the market's reason)."""
    names = {node_id_for(n.key.public_key_hex): name for name, n in nodes.items()}
    return {(t.role, t.index): (names.get(t.node_id), t.placement) for t in alice.job(job.id).tasks}


def test_a_core_quota_puts_a_worker_on_a_core_node_while_community_nodes_are_free(coordinator):
    alice, nodes, job = _network(coordinator, community=2, min_core_workers=1)
    assert nodes["core-agg"].lease().role == "aggregator"
    placed = _placed(alice, job, nodes)
    name, reason = placed[("worker", 0)]
    assert name == "core-spare"
    # useful TFLOPS: 1 TFLOPS x a new node's reliability (about 2/3, falling a hair with each missed beat)
    assert re.fullmatch(
        r"core node: the job asks for at least 1 core worker; rank 1 of 1 eligible core node by cost "
        r"per useful TFLOP \(0\.400 credits/h ÷ 0\.6\d* TFLOPS = 0\.[56]\d*\)",
        reason,
    ), reason
    assert placed[("worker", 1)][0] == "c0"
    assert nodes["core-spare"].lease().role == "worker"
    assert nodes["c1"].lease() is None  # free, but the job's workers are all placed


def test_a_replacement_worker_goes_to_community_when_the_quota_is_already_met(coordinator):
    alice, nodes, job = _network(coordinator, community=2, min_core_workers=1)
    grants = {name: nodes[name].lease() for name in ("core-agg", "core-spare", "c0")}
    gone = grants["c0"]
    nodes["c0"].report(gone.lease_id, m.LeaseReport(epoch=gone.epoch, outcome="released"))
    reap_once(coordinator.ctx)
    name, reason = _placed(alice, job, nodes)[("worker", gone.task.worker_index)]
    assert name == "c0" and reason.startswith("rank 1 of 2 eligible community nodes")
    assert not any("waits" in e.message for e in alice.logs(job.id))


def test_forbidden_fallback_waits_for_a_community_node_and_says_why_once(coordinator):
    alice, nodes, job = _network(coordinator, core_fallback=False, min_workers=1)
    nodes["core-agg"].lease()
    assert nodes["core-spare"].lease() is None  # free and eligible, but the job forbids core fallback
    placed = _placed(alice, job, nodes)
    assert placed[("worker", 0)][0] == "c0"
    name, reason = placed[("worker", 1)]  # `gpuflex job show` says why, node by node
    assert name is None and reason.startswith("waits: " + WAITS.removeprefix("worker 1 waits: ")), reason
    assert "core-spare: free, but a core node, and the job forbids core fallback" in reason
    assert "c0: busy (worker, placed)" in reason
    for _ in range(3):
        reap_once(coordinator.ctx)  # the reaper places every pass: the reason is told once, not each time
    assert sum(e.message.startswith(WAITS) for e in alice.logs(job.id)) == 1
    nodes["c1"] = coordinator.node("c1", price=0.2)
    grant = nodes["c1"].lease()
    assert (grant.role, grant.task.worker_index) == ("worker", 1)
    assert _placed(alice, job, nodes)[("worker", 1)][0] == "c1"


def test_a_job_places_nothing_until_min_workers_can_start_and_every_task_says_why(coordinator):
    """Gang placement: 3 workers asked (min_workers defaults to all), 2 community nodes free."""
    alice, nodes, job = _network(coordinator, community=2, spare=False, workers=3)
    for _ in range(3):
        reap_once(coordinator.ctx)
    detail = alice.job(job.id)
    why = (
        "2 of the 3 workers this job needs to start (resources.min_workers) can be placed now (on c0, c1): "
        "core-agg: kept for this job's aggregator"
    )
    assert detail.state == "pending"
    assert {(t.node_id, t.placement) for t in detail.tasks} == {(None, f"waits: {why}")}
    told = [e.message for e in alice.logs(job.id) if "wait" in e.message]
    assert told == [f"aggregator 0 and workers 0, 1, 2 wait: {why}"]
    assert alice.quote(detail.spec).problems == [why]  # the quote says the same
    assert nodes["c1"].lease() is None  # nothing is leased while the job cannot start
    nodes["c2"] = coordinator.node("c2", price=0.2)  # a third node: the whole gang is placed
    reap_once(coordinator.ctx)
    placed = _placed(alice, job, nodes)
    assert sorted(name for name, _ in placed.values()) == ["c0", "c1", "c2", "core-agg"]
    assert alice.job(job.id).state == "scheduled"


def test_min_workers_starts_the_job_and_the_rest_wait_with_their_reason_then_end_unplaced(coordinator):
    alice, nodes, job = _network(coordinator, community=2, spare=False, workers=3, min_workers=2)
    grants = [nodes[name].lease() for name in ("core-agg", "c0", "c1")]  # the job started on 2 workers
    assert [g.role for g in grants] == ["aggregator", "worker", "worker"]
    for _ in range(2):
        reap_once(coordinator.ctx)
    name, reason = _placed(alice, job, nodes)[("worker", 2)]
    why = "no free node qualifies"
    assert name is None and reason.startswith(f"waits: {why}: c0: busy ("), reason
    assert "core-agg: busy (aggregator, leased)" in reason
    assert sum(e.message.startswith(f"worker 2 waits: {why}") for e in alice.logs(job.id)) == 1
    alice.cancel(job.id)
    ended = {t.index if t.role == "worker" else -1: t for t in alice.job(job.id).tasks}
    assert [ended[i].state for i in (-1, 0, 1)] == ["cancelled"] * 3
    assert ended[2].state == "unplaced"  # it never ran: never `completed` nor `cancelled`
    assert ended[2].placement == "never placed: " + reason.removeprefix("waits: ")
    assert check_invariants(coordinator.ctx.settings.database_url) == []


def test_by_default_a_worker_falls_back_to_a_core_node(coordinator):
    alice, nodes, job = _network(coordinator)
    nodes["core-agg"].lease()
    name, reason = _placed(alice, job, nodes)[("worker", 1)]
    assert name == "core-spare"
    assert reason.endswith("; core node because only 1 eligible community node")
    assert nodes["core-spare"].lease().role == "worker"
    assert not any("waits" in e.message for e in alice.logs(job.id))


def test_a_heartbeat_tells_a_node_when_work_is_placed_on_it(coordinator):
    """Idle agents ask for a lease when told, rather than polling: the heartbeat says so."""
    alice, nodes, job = _network(coordinator, community=2)
    assert not any(node.heartbeat([]).work for node in nodes.values())  # submitted, not placed yet
    reap_once(coordinator.ctx)  # the reaper's placement pass
    told = {name for name, node in nodes.items() if node.heartbeat([]).work}
    placed = {name for name, _ in _placed(alice, job, nodes).values()}
    assert told == placed and len(told) == 3  # the aggregator and two workers
    grant = nodes["core-agg"].lease()
    held = [m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)]
    assert not nodes["core-agg"].heartbeat(held).work  # leased: nothing more waits for it


def test_lease_requests_run_a_placement_pass_at_most_once_per_interval(database_url, tmp_path):
    """A thousand agents asking at once must not each read the whole market: the reaper places anyway."""
    with running_coordinator(database_url, tmp_path, lease_placement_interval_s=3600) as coordinator:
        alice, nodes, _ = _network(coordinator, community=3)
        assert nodes["core-agg"].lease().role == "aggregator"  # the replica's one pass placed the job
        spec = JobSpec.model_validate(
            {"name": "t2", "resources": {"workers": 1}, "budget": 1.0, "max_price_per_hour": 0.5}
        )
        second = alice.submit(spec, alice.upload(b"corpus " * 2000))
        assert nodes["c2"].lease() is None  # nothing placed on it, and no pass due: no lease
        reap_once(coordinator.ctx)  # the reaper's pass places the new job
        assert any(node.lease() is not None for node in nodes.values())
        assert all(t.node_id is not None for t in alice.job(second.id).tasks)


@pytest.mark.parametrize(("analyze_after", "analyzed"), [(3, True), (4, False)])
def test_a_pass_that_places_many_tasks_refreshes_postgresql_statistics_of_them(
    postgres_server, tmp_path, monkeypatch, analyze_after, analyzed
):
    """Until the planner has seen the placed tasks, every lease batch scans all pending tasks."""
    monkeypatch.setattr(market, "ANALYZE_AFTER_PLACING", analyze_after)
    with scratch_postgres_database(postgres_server) as url, running_coordinator(url, tmp_path) as coordinator:
        alice, nodes, job = _network(coordinator)  # an aggregator and two workers to place
        reap_once(coordinator.ctx)
        assert all(name for name, _ in _placed(alice, job, nodes).values())
        with coordinator.ctx.read() as s:  # -1: never analyzed
            tuples = s.scalar(text("SELECT reltuples FROM pg_class WHERE relname = 'tasks'"))
        assert tuples == (3 if analyzed else -1)
