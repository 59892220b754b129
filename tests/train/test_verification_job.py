"""Verification through the round protocol: LocalTransport's audit draw and exclusion, and a job whose
cheater is caught, reported and shut out while the honest workers finish it."""

import pytest

from gpuflex.errors import Conflict
from gpuflex.protocol.messages import (
    AuditStateSubmit,
    Commitment,
    ContributionSubmit,
    RoundPublish,
    VerdictSubmit,
)
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport

from .helpers import POLL, ThreadedJob, task_config, tiny_spec

TIMEOUT = 120


def _commitment(segments: int) -> Commitment:
    return Commitment(
        seed=1, start="a" * 64, data="b" * 64, every=1, trace=["c" * 16] * segments, device="cpu/1t"
    )


def _open(t: LocalTransport) -> None:
    t.publish_round(RoundPublish(round=0, state_hash="d" * 64, checkpoint=t.put_blob(b"state")))


def _submit(t: LocalTransport, commitment: Commitment | None):
    c = ContributionSubmit(
        round=0, delta=t.put_blob(b"delta"), tokens=1, steps=1, train_loss=1.0, commitment=commitment
    )
    return t.submit_contribution(c)


def test_draws_need_a_commitment_and_an_audit_state_answers_only_its_draw():
    t = LocalTransport(2, 2, audit_rate=1.0)
    _open(t)
    assert _submit(t.for_task("w0"), None).audit_segment is None
    receipt = _submit(t.for_task("w1"), _commitment(4))
    assert receipt.accepted and receipt.audit_segment in range(4)
    state = t.put_blob(b"segment")
    with pytest.raises(Conflict):
        t.for_task("w0").submit_audit_state(AuditStateSubmit(round=0, segment=0, state=state))
    with pytest.raises(Conflict):
        t.for_task("w1").submit_audit_state(
            AuditStateSubmit(round=0, segment=(receipt.audit_segment + 1) % 4, state=state)
        )
    t.for_task("w1").submit_audit_state(AuditStateSubmit(round=0, segment=receipt.audit_segment, state=state))
    (entry,) = [c for c in t.contributions(0).contributions if c.task_id == "w1"]
    assert entry.audit_state == state


def test_a_guilty_verdict_discards_the_contribution_and_excludes_the_task():
    t = LocalTransport(2, 2)
    _open(t)
    _submit(t.for_task("w0"), None)
    t.report_verdict(
        VerdictSubmit(round=0, task_id="w0", guilty=True, check="screen", reason="no commitment")
    )
    assert t.contributions(0).contributions == [] and t.contributions(0).live_workers == 1
    with pytest.raises(Conflict, match="excluded"):
        _submit(t.for_task("w0"), None)
    (verdict,) = t.verdicts()
    assert verdict.node_id == "node-w0" and verdict.guilty


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_cheater_is_caught_reported_and_excluded_while_the_honest_finish(corpus, optimizer):
    spec = tiny_spec(rounds=3, inner_steps=4, inner_optimizer=optimizer, verification={"trace_every": 1})
    transport = LocalTransport(spec.rounds, live_workers=4, audit_rate=1.0)
    with ThreadedJob(transport, spec, transport.put_blob(corpus), num_workers=4) as job:
        honest = [job.start("worker", i) for i in range(3)]
        config = task_config(spec, job.dataset, "worker", 3, 4).model_copy(update={"adversary": "fake-trace"})
        view = transport.for_task(config.task_id)
        cheater = job.pool.submit(run_task, config, view, job.stopping.is_set, poll_interval_s=POLL)
        assert job.start("aggregator").result(timeout=TIMEOUT)["finished"]
        assert all(w.result(timeout=TIMEOUT)["finished"] for w in honest)
        assert cheater.result(timeout=TIMEOUT)["finished"] is False  # shut out, not finished
    verdicts = transport.verdicts()
    guilty = [v for v in verdicts if v.guilty]
    assert [v.task_id for v in guilty] == ["worker-3"] and guilty[0].check == "audit"
    assert all(not v.guilty for v in verdicts if v.task_id != "worker-3")
    assert any(v.check == "audit" and not v.guilty for v in verdicts)  # honest audits are reported too
