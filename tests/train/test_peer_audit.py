"""Peer audits: a second provider re-runs drawn segments, and the core node re-runs only a dispute's
first divergent segment, convicting whom its re-run contradicts (the worker or the peer)."""

import pytest
from pydantic import ValidationError

from gpuflex.protocol.messages import PeerAuditAssign, PeerAuditReport
from gpuflex.train.peer_audit import Order, first_divergence
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport

from .helpers import POLL, ThreadedJob, task_config, tiny_spec

TIMEOUT = 120
SEGMENTS = 4  # inner_steps 8, every 2
PEER = {"trace_every": 2, "peer_segments": SEGMENTS}


def test_the_first_divergence_is_the_first_segment_whose_hash_differs_or_is_missing():
    trace = ["a" * 16, "b" * 16, "c" * 16, "d" * 16]
    assert first_divergence(trace, 1, ["b" * 16, "c" * 16], 2) is None
    assert first_divergence(trace, 1, ["b" * 16, "0" * 16, "d" * 16], 3) == 2
    assert first_divergence(trace, 0, ["a" * 16], 3) == 1  # a missing hash is no agreement


def test_peer_audits_need_robust_verification_and_synchronous_rounds():
    with pytest.raises(ValidationError, match="peer_segments"):
        tiny_spec(overlap=True, verification=PEER)
    with pytest.raises(ValidationError, match="peer_segments"):
        tiny_spec(verification={**PEER, "robust": False})


def test_an_order_holds_the_start_and_learning_rates_and_nothing_committed_after_it():
    import torch

    order = Order(4, {"p.w": torch.ones(3)}, [[0.1, 0.2], [0.3]])
    back = Order.from_bytes(order.to_bytes())
    assert (back.step, back.lrs, back.steps, list(back.start)) == (4, [[0.1, 0.2], [0.3]], 7, ["p.w"])


def test_a_worker_sees_only_its_own_orders_until_it_reports_them():
    t = LocalTransport(2, 3, audit_rate=1.0)
    from .test_verification_job import _commitment, _open, _submit

    _open(t)
    segment = _submit(t.for_task("w0"), _commitment(4)).audit_segment
    agg, state = t.for_task("agg"), t.put_blob(b"order")
    order = PeerAuditAssign(round=0, task_id="w0", auditor="w1", worker=0, segment=segment, state=state)
    agg.assign_peer_audit(order)
    assert [a.task_id for a in t.for_task("w1").peer_audits().audits] == ["w0"]
    assert t.for_task("w2").peer_audits().audits == []
    t.for_task("w1").report_peer_audit(PeerAuditReport(round=0, task_id="w0", hashes=["e" * 16]))
    assert t.for_task("w1").peer_audits().audits == []
    assert [a.hashes for a in agg.peer_audits(0).audits] == [["e" * 16]]


def _job(corpus: bytes, adversary: str | None) -> tuple[LocalTransport, list, object]:
    """An honest worker and a second one (playing ``adversary``), each the other's only possible peer;
    every contribution drawn. Returns the transport, the honest result and the other's."""
    spec = tiny_spec(rounds=2, inner_steps=8, verification=PEER)
    # audit seed 2 draws segments 0 and 2 in round 0 (whoever submits first): neither is the last
    transport = LocalTransport(spec.rounds, live_workers=2, audit_rate=1.0, audit_seed=2)
    with ThreadedJob(transport, spec, transport.put_blob(corpus), num_workers=2) as job:
        honest = job.start("worker", 0)
        config = task_config(spec, job.dataset, "worker", 1, 2).model_copy(update={"adversary": adversary})
        other = job.pool.submit(
            run_task, config, transport.for_task(config.task_id), job.stopping.is_set, poll_interval_s=POLL
        )
        assert job.start("aggregator").result(timeout=TIMEOUT)["finished"]
        return transport, honest.result(timeout=TIMEOUT), other.result(timeout=TIMEOUT)


def _order(transport: LocalTransport, round: int, task_id: str):
    (order,) = [
        a for a in transport.for_task("aggregator-0").peer_audits(round).audits if a.task_id == task_id
    ]
    return order


def test_honest_peers_clear_each_other_and_the_core_node_re_runs_nothing(corpus):
    transport, honest, other = _job(corpus, None)
    assert honest["finished"] and other["finished"]
    verdicts = transport.verdicts()
    assert len(verdicts) == 4 and all(v.check == "peer-audit" and not v.guilty for v in verdicts)
    for v in verdicts:  # each re-run by the other worker, from the drawn segment to the trace's end
        assert v.evidence["peer"] != v.task_id
        assert v.evidence["segments"] == SEGMENTS - v.evidence["segment"]
    assert honest["peer_audit_s"] > 0 and other["peer_audit_s"] > 0
    assert sum("as its peer" in line for _, line in transport.logs()) == 4


def test_a_shirker_s_peer_disputes_its_trace_and_the_core_node_convicts_it(corpus):
    transport, honest, _ = _job(corpus, "bf16")
    assert honest["finished"]  # the convicted one may still see the job finish before its next submit
    (guilty,) = [v for v in transport.verdicts() if v.guilty]
    assert guilty.task_id == "worker-1" and guilty.check == "dispute"
    assert guilty.evidence["peer"] == "worker-0" and "does not reproduce its trace" in guilty.reason
    # every bf16 step differs: the dispute is the drawn segment, the first its peer re-ran
    order = _order(transport, guilty.round, "worker-1")
    assert guilty.evidence["segment"] == order.segment and order.hashes[0] == guilty.evidence["peer_hash"]


def test_a_peer_that_frames_an_honest_worker_is_convicted_by_the_core_node_s_re_run(corpus):
    transport, honest, _ = _job(corpus, "framer")
    assert honest["finished"]
    verdicts = transport.verdicts()
    (guilty,) = [v for v in verdicts if v.guilty]
    assert guilty.task_id == "worker-1" and guilty.check == "dispute" and guilty.round == 0
    (cleared,) = [v for v in verdicts if v.check == "dispute" and not v.guilty]
    assert cleared.task_id == "worker-0" and cleared.evidence["peer"] == "worker-1"
    # the framer changed only its last hash: the core node re-ran that one segment, not the drawn one
    order = _order(transport, 0, "worker-0")
    assert order.segment < SEGMENTS - 1 and order.hashes is not None
    assert order.segment + len(order.hashes) == SEGMENTS
    assert cleared.evidence["segment"] == SEGMENTS - 1 == guilty.evidence["segment"]
