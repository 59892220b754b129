"""Lease requests granted together (``coordinator.groupcommit``): one batch, one transaction, and each
request answered as if it had come alone."""

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event, select

from gpuflex.coordinator.db import Lease, Task
from gpuflex.coordinator.groupcommit import LeaseGranter
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.services import specs
from gpuflex.coordinator.services.registry import Call
from gpuflex.errors import Unauthorized
from gpuflex.protocol.spec import JobSpec


def _spec(workers: int) -> dict:
    return {"name": "t", "resources": {"workers": workers}, "budget": 1.0, "max_price_per_hour": 0.5}


def _job(coordinator, workers: int):
    alice = coordinator.consumer("alice", deposit=10)
    return alice.submit(JobSpec.model_validate(_spec(workers)), alice.upload(b"corpus " * 2000))


def _call(node) -> Call:
    return Call(node.key.node_id, secrets.token_hex(16))


def test_a_batch_of_lease_requests_gives_each_node_its_own_task_and_refuses_each_bad_request_alone(
    coordinator,
):
    nodes = [coordinator.node("core", core=True, price=0.4)]
    nodes += [coordinator.node(f"c{i}", price=0.1 + i / 100) for i in range(3)]
    gone = coordinator.node("gone")
    gone.leave()
    job = _job(coordinator, workers=3)
    calls = [_call(n) for n in nodes]
    again = _call(nodes[1])  # the same node asking twice at once
    calls += [again, Call(again.node_id, again.nonce), _call(gone), Call("nobody", secrets.token_hex(16))]

    with coordinator.ctx.tx() as s:
        answers = LeaseGranter(coordinator.ctx, CoordinatorMetrics(coordinator.ctx)).write(s, calls)

    grants, (twice, replayed, left, unknown) = answers[:4], answers[4:]
    assert [g.role for g in grants] == ["aggregator", "worker", "worker", "worker"]
    assert sorted(g.task.worker_index for g in grants[1:]) == [0, 1, 2]
    assert len({g.task_id for g in grants}) == 4 and {g.job_id for g in grants} == {job.id}
    assert all(g.epoch == 1 for g in grants)
    assert twice is None  # its first request holds the node's one task
    assert isinstance(replayed, Unauthorized) and "replayed" in str(replayed)
    assert isinstance(left, Unauthorized) and "has left" in str(left)
    assert isinstance(unknown, Unauthorized) and "unknown node" in str(unknown)
    with coordinator.ctx.tx() as s:
        leases = s.execute(select(Lease.node_id, Lease.task_id, Lease.epoch).where(Lease.state == "active"))
        assert sorted(leases) == sorted(
            (n.key.node_id, g.task_id, 1) for n, g in zip(nodes, grants, strict=True)
        )
        assert set(s.scalars(select(Task.state))) == {"leased"}
    assert nodes[1].lease() is None  # one lease per node


def test_a_batch_reads_a_jobs_spec_only_if_this_process_has_not_parsed_it(coordinator, monkeypatch):
    """A job's spec never changes: a replica parses it once, not in every lease batch."""
    nodes = [coordinator.node("core", core=True, price=0.4)]
    nodes += [coordinator.node(f"c{i}", price=0.1) for i in range(3)]
    job = _job(coordinator, workers=3)
    writer = LeaseGranter(coordinator.ctx, CoordinatorMetrics(coordinator.ctx))
    statements: list[str] = []

    def batch(asking) -> list:
        statements.clear()
        with coordinator.ctx.tx() as s:
            return writer.write(s, [_call(n) for n in asking])

    def record(_conn, _cursor, statement, *_):
        statements.append(statement)

    assert batch(nodes[:1])[0].role == "aggregator"  # this one places the job's tasks
    monkeypatch.setattr(specs, "SPECS", specs.SpecCache())  # as a replica that never saw the job
    event.listen(coordinator.ctx.engine, "before_cursor_execute", record)
    try:
        unseen = batch(nodes[1:3])
        reads_unseen = [s for s in statements if "jobs.spec" in s]
        seen = batch(nodes[3:])
        reads_seen = [s for s in statements if "jobs.spec" in s]
    finally:
        event.remove(coordinator.ctx.engine, "before_cursor_execute", record)

    assert len(reads_unseen) == 1 and reads_seen == []
    assert {g.job_id for g in unseen + seen} == {job.id}
    training = JobSpec.model_validate(_spec(workers=3)).training
    assert all(g.task.num_workers == 3 and g.task.training == training for g in unseen + seen)


def test_nodes_asking_at_once_over_http_each_get_one_task_and_no_task_is_leased_twice(coordinator):
    nodes = [coordinator.node("core", core=True, price=0.4)]
    nodes += [coordinator.node(f"c{i}", price=0.1) for i in range(7)]
    _job(coordinator, workers=7)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda n: n.lease(), nodes + nodes))  # each node asks twice

    grants = [a for a in answers if a is not None]
    assert len(grants) == 8 and len({g.task_id for g in grants}) == 8
    with coordinator.ctx.tx() as s:
        holders = list(s.scalars(select(Lease.node_id).where(Lease.state == "active")))
    assert sorted(holders) == sorted(n.key.node_id for n in nodes)


def test_every_call_of_a_batch_hears_back_even_if_counting_an_answer_fails(coordinator):
    """Once its batch is committed, a call is answered: a failing metric or log does not strand the
    rest of the batch (nor stop the writer thread)."""

    class Flaky(LeaseGranter):
        def answered(self, call, answer):
            raise RuntimeError("the metrics backend is down")

    nodes = [coordinator.node(f"c{i}", price=0.1) for i in range(3)]
    _job(coordinator, workers=2)
    writer = Flaky(coordinator.ctx, CoordinatorMetrics(coordinator.ctx))
    writer.start()
    try:
        for _ in range(2):  # the thread survives a first batch
            answers = [f.result(timeout=30) for f in [writer.submit(_call(n)) for n in nodes]]
        assert all(a is None or a.job_id for a in answers)
    finally:
        writer.stop()


def test_a_call_that_fails_its_check_is_refused_with_why_and_never_written(coordinator):
    """Checks run on the writer's checker threads before a call joins a batch; what one raises is that
    call's answer, and the calls that pass are written. Stopping writes what the checkers passed."""
    coordinator.node("core", core=True)  # the job's aggregator: it starts only with it placed too
    nodes = [coordinator.node(f"c{i}", price=0.1) for i in range(3)]
    _job(coordinator, workers=2)
    writer = LeaseGranter(coordinator.ctx, CoordinatorMetrics(coordinator.ctx))

    def forged() -> None:
        raise Unauthorized("bad request signature")

    writer.start()
    refused = writer.submit(_call(nodes[0]), forged)
    passed = [writer.submit(_call(n), lambda: None) for n in nodes[1:]]
    writer.stop()

    with pytest.raises(Unauthorized, match="signature"):
        refused.result(timeout=0)
    assert all(f.result(timeout=0).job_id for f in passed)
    with coordinator.ctx.tx() as s:
        holders = set(s.scalars(select(Lease.node_id).where(Lease.state == "active")))
    assert holders == {n.key.node_id for n in nodes[1:]}


def test_under_load_a_batch_waits_for_as_many_calls_as_the_one_before_and_a_lone_call_for_none(coordinator):
    """The callers a batch answered ask again at once: the next batch waits for them (up to ``linger_s``)
    rather than going with the one call queued meanwhile and leaving them to the batch after."""
    sizes: list[int] = []
    gate = threading.Semaphore(0)  # each batch is written once the test lets it

    class Gated(LeaseGranter):
        def write(self, session, calls):
            sizes.append(len(calls))
            assert gate.acquire(timeout=30)
            return super().write(session, calls)

    nodes = [coordinator.node(f"c{i}", price=0.1) for i in range(9)]
    writer = Gated(coordinator.ctx, CoordinatorMetrics(coordinator.ctx), linger_s=60)  # only a count ends it

    def until(done) -> None:
        for _ in range(1000):
            if done():
                return
            time.sleep(0.01)
        raise AssertionError(f"batches so far: {sizes}")

    writer.start()
    try:
        calls = [writer.submit(_call(nodes[0]))]
        until(lambda: sizes == [1])  # alone, at once: far sooner than the 60 s it would wait
        calls += [writer.submit(_call(n)) for n in nodes[1:5]]  # queued while the first is written
        gate.release()
        until(lambda: sizes == [1, 4])
        calls.append(writer.submit(_call(nodes[5])))
        gate.release()
        until(writer._queue.empty)  # the writer took it, and waits for three more
        calls += [writer.submit(_call(n)) for n in nodes[6:9]]
        until(lambda: len(sizes) == 3)
        gate.release()
        assert sizes == [1, 4, 4]
    finally:
        for _ in range(3):
            gate.release()
        writer.stop()
    assert all(f.result(timeout=30) is None for f in calls)  # nothing placed on them: answered, empty
