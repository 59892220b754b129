"""The round protocol, leases with epochs, liveness and settlement, driven through the real API."""

import re

import pytest
from sqlalchemy.exc import IntegrityError

from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Lease
from gpuflex.coordinator.services import jobs, leases
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.ledger import accounts
from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import balances, verify_chain
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

H0 = "ab" * 32  # a stand-in state hash: the coordinator stores it, the replicas check it


def _spec(workers=2, rounds=2, budget=1.0, max_price=0.5) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "resources": {"workers": workers},
            "budget": budget,
            "max_price_per_hour": max_price,
            "training": {"rounds": rounds},
        }
    )


def _network(coordinator, workers=2):
    alice = coordinator.consumer("alice", deposit=10)
    core = coordinator.node("core", core=True, price=0.4)
    community = [coordinator.node(f"c{i}", price=0.1 + i / 100) for i in range(workers)]
    job = alice.submit(_spec(workers), alice.upload(b"corpus " * 2000))
    return alice, core, community, job


def test_market_places_aggregator_on_core_and_workers_on_community(coordinator):
    alice, core, community, job = _network(coordinator)
    grants = {"core": core.lease(), **{f"c{i}": n.lease() for i, n in enumerate(community)}}
    assert grants["core"].role == "aggregator"
    assert {grants["c0"].role, grants["c1"].role} == {"worker"}
    assert sorted(g.task.worker_index for g in (grants["c0"], grants["c1"])) == [0, 1]
    detail = alice.job(job.id)
    assert detail.state == "running"
    assert all(t.placement for t in detail.tasks)
    assert "core" in next(t.placement for t in detail.tasks if t.role == "aggregator")
    assert core.lease() is None  # one task per node


def test_a_whole_job_through_rounds_settles_and_conserves_money(coordinator):
    alice, core, community, job = _network(coordinator)
    agg = coordinator.task(core.lease())
    workers = [coordinator.task(n.lease()) for n in community]
    assert workers[0].latest_round() is None
    agg.publish_round(
        m.RoundPublish(round=0, state_hash=H0, checkpoint=agg.put_blob(b"state-0"), val_loss=5.5)
    )
    for r in (0, 1):
        coordinator.clock.advance(10)
        for node in (core, *community):
            node.heartbeat([])  # keeps the nodes online (leases renewed below)
        state = workers[0].latest_round()
        assert (state.round, state.finished) == (r, False)
        for i, w in enumerate(workers):
            delta = w.put_blob(f"delta-{r}-{i}".encode())
            assert w.submit_contribution(
                m.ContributionSubmit(round=r, delta=delta, tokens=100, steps=5, train_loss=3.0)
            ).accepted
        listed = agg.contributions(r)
        assert (len(listed.contributions), listed.live_workers) == (2, 2)
        with pytest.raises(Forbidden):
            workers[0].publish_round(m.RoundPublish(round=r + 1, state_hash=H0, update=delta))
        update = agg.put_blob(f"update-{r + 1}".encode())
        state = agg.put_blob(f"state-{r + 1}".encode()) if r == 1 else None  # the last round's is required
        agg.publish_round(
            m.RoundPublish(
                round=r + 1,
                state_hash=H0,
                update=update,
                checkpoint=state,
                val_loss=5.0 - r,
                contributions=2,
                tokens=200 * (r + 1),
            )
        )
        assert workers[0].round_state(r + 1).update == update
        late = m.ContributionSubmit(round=r, delta=delta, tokens=1, steps=1, train_loss=1.0)
        assert workers[1].submit_contribution(late).accepted is False  # the round closed: turned away
    final = alice.job(job.id)
    assert final.state == "completed" and workers[0].latest_round().finished
    assert (final.initial_val_loss, final.val_loss) == (5.5, 4.0)
    assert alice.checkpoint(job.id) == b"state-2"
    assert [(r.round, r.tokens) for r in alice.job(job.id).rounds_log] == [(0, 0), (1, 200), (2, 400)]
    journal = from_export(alice.ledger())
    assert verify_chain(journal).ok
    totals = balances(journal)
    assert sum(totals.values()) == 0
    assert totals.get(accounts.escrow(job.id), 0) == 0
    paid = sum(v for k, v in totals.items() if k.startswith(accounts.HELD))  # until the audit window ends
    fees = totals[accounts.PLATFORM_FEES]
    assert paid > 0 and fees > 0 and fees == pytest.approx(paid / 9, rel=0.01)
    (wallet,) = (v for k, v in totals.items() if k.startswith("consumer:"))
    assert wallet == 10_000_000 - round(final.spent * 1e6) == round(alice.balance().balance * 1e6)
    assert paid + fees == round(final.spent * 1e6)


def test_an_expired_lease_is_re_leased_with_a_higher_epoch_and_stale_reports_change_nothing(coordinator):
    alice, core, community, job = _network(coordinator, workers=1)
    core.lease()
    old = community[0].lease()
    spare = coordinator.node("spare", price=0.2)
    coordinator.clock.advance(20)  # past the 15 s lease; the old node went silent
    for node in (core, spare):
        node.heartbeat([])
    reap_once(coordinator.ctx)
    new = spare.lease()
    assert new is not None and new.task_id == old.task_id and new.epoch == old.epoch + 1
    with pytest.raises(Conflict, match=r"stale epoch|already ended"):
        community[0].report(old.lease_id, m.LeaseReport(epoch=old.epoch, outcome="completed"))
    with pytest.raises(Conflict, match="has ended"):
        coordinator.task(old).latest_round()
    task = next(t for t in alice.job(job.id).tasks if t.id == old.task_id)
    assert (task.state, task.epoch, task.node_id) == ("leased", new.epoch, spare.key.node_id)
    events = " ".join(e.message for e in alice.logs(job.id))
    assert "missed its lease" in events


def test_a_replacement_workers_contribution_replaces_its_lost_predecessors(coordinator):
    _, core, community, _ = _network(coordinator, workers=1)
    aggregator_grant = core.lease()
    agg = coordinator.task(aggregator_grant)
    agg.publish_round(m.RoundPublish(round=0, state_hash=H0, checkpoint=agg.put_blob(b"state-0")))
    first = coordinator.task(community[0].lease())
    delta = first.put_blob(b"first")
    for _ in range(2):  # a retried submission is accepted again, not a conflict
        assert first.submit_contribution(
            m.ContributionSubmit(round=0, delta=delta, tokens=1, steps=1, train_loss=3)
        ).accepted
    spare = coordinator.node("spare", price=0.2)
    coordinator.clock.advance(20)
    core.heartbeat([m.LeaseHeld(lease_id=aggregator_grant.lease_id, epoch=aggregator_grant.epoch)])
    spare.heartbeat([])
    reap_once(coordinator.ctx)
    second = coordinator.task(spare.lease())
    redo = second.put_blob(b"second")
    assert second.submit_contribution(
        m.ContributionSubmit(round=0, delta=redo, tokens=2, steps=2, train_loss=2)
    ).accepted
    (only,) = agg.contributions(0).contributions
    assert (only.delta, only.node_id, only.tokens) == (redo, spare.key.node_id, 2)


def test_a_report_with_a_stale_epoch_is_refused(coordinator):
    _, core, community, _ = _network(coordinator, workers=1)
    grant = community[0].lease()
    with pytest.raises(Conflict, match="stale epoch"):
        community[0].report(grant.lease_id, m.LeaseReport(epoch=grant.epoch - 1, outcome="failed"))
    with pytest.raises(Forbidden, match="another node"):
        core.report(grant.lease_id, m.LeaseReport(epoch=grant.epoch, outcome="failed"))


def test_heartbeats_renew_leases_and_revoke_unknown_ones(coordinator):
    _, _, community, _ = _network(coordinator, workers=1)
    grant = community[0].lease()
    ack = community[0].heartbeat(
        [m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch), m.LeaseHeld(lease_id="l-unknown", epoch=1)]
    )
    assert ack.revoked == ["l-unknown"]
    for _ in range(5):  # every 5 s: within the 6 s a node may stay silent
        coordinator.clock.advance(5)
        community[0].heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    coordinator.clock.advance(4)  # 29 s after the grant (the lease lives 15 s), 4 s after a renewal
    reap_once(coordinator.ctx)
    assert coordinator.task(grant).latest_round() is None


def test_a_lost_nodes_lease_ends_at_once_and_its_late_report_changes_nothing(coordinator):
    """Loss is judged by heartbeats (6 s here), well before the lease's own 15 s expiry."""
    alice, core, community, job = _network(coordinator, workers=1)
    spare = coordinator.node("spare", price=0.2)
    grant = community[0].lease()
    coordinator.clock.advance(7)
    for node in (core, spare):
        node.heartbeat([])
    reap_once(coordinator.ctx)  # the lease would live until 15 s; the node is lost at 6 s
    events = [e.message for e in alice.logs(job.id)]
    # 7 s of the clock's advance plus the real seconds the test took since the node's last word (over 1 s
    # on a loaded machine): lost past the 6 s limit, and before the lease's own 15 s
    lost = [e for e in events if re.search(r"lost \(no heartbeat for [\d.]+s, limit 6s\); re-leasing", e)]
    assert len(lost) == 1, events
    assert 7 <= float(re.search(r"for ([\d.]+)s", lost[0])[1]) < 15, lost
    regrant = spare.lease()
    assert (regrant.task_id, regrant.epoch) == (grant.task_id, grant.epoch + 1)
    # the lost node comes back after its network cut: it learns its lease is gone, and its word is refused
    assert community[0].heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)]).revoked == [
        grant.lease_id
    ]
    with pytest.raises(Conflict, match="already ended"):
        community[0].report(grant.lease_id, m.LeaseReport(epoch=grant.epoch, outcome="failed"))
    with pytest.raises(Conflict, match="has ended"):
        coordinator.task(grant).submit_contribution(
            m.ContributionSubmit(round=0, delta="0" * 64, tokens=1, steps=1, train_loss=None)
        )
    task = next(t for t in alice.job(job.id).tasks if t.id == grant.task_id)
    spare_id = next(o.node_id for o in alice.offers() if o.name == "spare")
    assert (task.state, task.epoch, task.node_id) == ("leased", grant.epoch + 1, spare_id)


def test_the_quorum_does_not_wait_for_a_worker_whose_node_went_quiet(coordinator):
    coordinator.clock.freeze()  # 4.5 s of 6: a loaded machine's own seconds must not add to them
    alice, core, community, job = _network(coordinator, workers=2)
    agg = coordinator.task(core.lease())
    workers = [coordinator.task(n.lease()) for n in community]
    agg.publish_round(m.RoundPublish(round=0, state_hash=H0, checkpoint=agg.put_blob(b"s0")))
    delta = workers[0].put_blob(b"d0")
    workers[0].submit_contribution(
        m.ContributionSubmit(round=0, delta=delta, tokens=8, steps=1, train_loss=None)
    )
    assert agg.contributions(0).live_workers == 2  # one in, one owed by a worker heard from lately
    coordinator.clock.advance(4.5)  # community[1] missed two heartbeats (2 s each): suspected, not lost
    for node in (core, community[0]):
        node.heartbeat([])
    assert agg.contributions(0).live_workers == 1
    reap_once(coordinator.ctx)
    assert all(t.state == "leased" for t in alice.job(job.id).tasks)  # nothing was declared lost yet


def test_a_worker_that_joins_during_a_round_is_not_waited_for_until_the_next(coordinator):
    _, core, community, _ = _network(coordinator, workers=2)
    agg = coordinator.task(core.lease())
    early = coordinator.task(community[0].lease())
    agg.publish_round(m.RoundPublish(round=0, state_hash=H0, checkpoint=agg.put_blob(b"s0")))
    coordinator.clock.advance(0.5)
    late = coordinator.task(community[1].lease())  # e.g. a replacement, still starting up
    assert agg.contributions(0).live_workers == 1
    for i, worker in enumerate((early, late)):  # it made it in time after all: it counts
        delta = worker.put_blob(b"d%d" % i)
        worker.submit_contribution(
            m.ContributionSubmit(round=0, delta=delta, tokens=8, steps=1, train_loss=None)
        )
    assert agg.contributions(0).live_workers == 2
    update = agg.put_blob(b"u1")
    agg.publish_round(m.RoundPublish(round=1, state_hash=H0, update=update, checkpoint=None))
    assert agg.contributions(1).live_workers == 2  # from the next round on, both are owed


def test_the_database_itself_refuses_a_second_live_lease_of_a_task(coordinator):
    """Whatever a coordinator replica's code does, one task never has two active leases."""
    _, _, community, _ = _network(coordinator, workers=1)
    grant = community[0].lease()

    def another(state: str) -> None:
        with coordinator.ctx.tx() as s:
            live = s.get(Lease, grant.lease_id)
            s.add(Lease(**{**_columns(live), "id": f"l-{state}", "token_hash": state, "state": state}))

    another("expired")  # ended leases of a task are many: its history
    with pytest.raises(IntegrityError):
        another("active")


def _columns(row) -> dict:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}


def test_silent_nodes_are_marked_lost(coordinator):
    alice = coordinator.consumer("alice")
    quiet, chatty = coordinator.node("quiet"), coordinator.node("chatty")
    coordinator.clock.advance(7)
    chatty.heartbeat([])
    reap_once(coordinator.ctx)
    states = {o.name: o.state for o in alice.offers()}
    assert states == {"quiet": "lost", "chatty": "online"}
    assert quiet is not None


def test_a_failed_task_is_retried_then_fails_the_job(coordinator):
    alice, _, community, job = _network(coordinator, workers=1)
    for _ in range(3):
        grant = community[0].lease()
        community[0].report(grant.lease_id, m.LeaseReport(epoch=grant.epoch, outcome="failed", detail="boom"))
        reap_once(coordinator.ctx)
    final = alice.job(job.id)
    assert final.state == "failed" and "failed 3 times" in final.reason
    assert alice.balance().balance == pytest.approx(10 - final.spent)


def test_a_jobs_metered_cost_counts_every_lease_it_had_the_ended_as_they_ended_the_live_until_now(
    coordinator,
):
    alice, core, community, job = _network(coordinator, workers=2)
    unplaced = alice.submit(_spec(1), alice.upload(b"y" * 1000))  # every node is busy: no lease yet
    core.lease()
    first = community[0].lease()
    coordinator.clock.advance(30)
    community[0].report(first.lease_id, m.LeaseReport(epoch=first.epoch, outcome="failed", detail="boom"))
    community[1].lease()
    again = community[0].lease()  # the failed task, re-leased: the job's third worker lease
    assert again.task_id == first.task_id and again.epoch == first.epoch + 1
    coordinator.clock.advance(12)
    community[0].heartbeat([m.LeaseHeld(lease_id=again.lease_id, epoch=again.epoch)])
    coordinator.clock.advance(5)  # past the last renewal, within the lease's life
    now = coordinator.ctx.now()
    with coordinator.ctx.tx() as s:
        every = s.query(Lease).filter(Lease.job_id == job.id).all()
        assert sorted(lease.state for lease in every) == ["active", "active", "active", "failed"]
        expected = sum(leases.metered_cost(lease, now) for lease in every)
        assert jobs.metered(s, [job.id, unplaced.id], now) == {job.id: expected, unplaced.id: 0}
    assert expected > 0


def test_a_job_that_spends_its_budget_is_stopped(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    coordinator.node("core", core=True, price=0.4)
    pricey = coordinator.node("w", price=0.5)
    job = alice.submit(_spec(workers=1, budget=0.0002), alice.upload(b"x" * 1000))
    grant = pricey.lease()
    coordinator.clock.advance(10)
    pricey.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    reap_once(coordinator.ctx)
    final = alice.job(job.id)
    assert final.state == "out_of_budget" and final.reason == "budget spent"
    assert verify_chain(from_export(alice.ledger())).ok
    assert alice.balance().balance == pytest.approx(10 - final.spent)
    assert final.spent == pytest.approx(0.0002)  # charged the whole budget, not the overshoot


def test_a_task_placed_on_a_node_that_vanishes_before_leasing_is_placed_again(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    core = coordinator.node("core", core=True, price=0.4)
    cheap = coordinator.node("cheap", price=0.1)
    job = alice.submit(_spec(workers=1), alice.upload(b"x" * 1000))
    reap_once(coordinator.ctx)  # places the worker on the cheapest node
    assert {t.node_id for t in alice.job(job.id).tasks if t.role == "worker"} == {cheap.key.node_id}
    backup = coordinator.node("backup", price=0.3)
    coordinator.clock.advance(7)  # "cheap" never leases and goes silent
    for node in (core, backup):
        node.heartbeat([])
    reap_once(coordinator.ctx)
    grant = backup.lease()
    assert grant is not None and grant.role == "worker"


def test_a_restarted_node_gets_its_old_lease_fenced_off_and_can_lease_again(coordinator):
    _, _, community, _ = _network(coordinator, workers=1)
    old = community[0].lease()
    community[0].register(  # the agent restarted with the same key
        m.NodeRegister(
            name="c0",
            public_key=community[0].key.public_key_hex,
            price_per_hour=0.1,
            hardware=m.HardwareProfile(cpu_model="test cpu", cpu_cores=2, ram_gb=4),
            benchmark=m.BenchmarkResult(tflops_fp32=1, mem_bandwidth_gbps=10),
        )
    )
    with pytest.raises(Conflict, match="has ended"):
        coordinator.task(old).latest_round()
    new = community[0].lease()
    assert new is not None and new.task_id == old.task_id and new.epoch == old.epoch + 1


def test_an_aggregator_of_a_job_cancelled_before_round_0_stops_at_once(coordinator):
    from gpuflex.train.aggregator import run_aggregator

    alice, core, _, job = _network(coordinator, workers=1)
    grant = core.lease()
    alice.cancel(job.id)
    state = coordinator.task(grant).latest_round()
    assert (state.finished, state.checkpoint, state.round) == (True, None, -1)
    summary = run_aggregator(grant.task, coordinator.task(grant), poll_interval_s=0.01)
    assert summary.finished and summary.round == -1


def test_a_round_must_carry_what_replicas_need(coordinator):
    _, core, _, _ = _network(coordinator, workers=1)
    agg = coordinator.task(core.lease())
    with pytest.raises(BadRequest, match="full state"):
        agg.publish_round(m.RoundPublish(round=0, state_hash=H0))
    agg.publish_round(m.RoundPublish(round=0, state_hash=H0, checkpoint=agg.put_blob(b"state-0")))
    with pytest.raises(BadRequest, match="aggregated update"):
        agg.publish_round(m.RoundPublish(round=1, state_hash=H0))
    with pytest.raises(NotFound):
        agg.round_state(5)
