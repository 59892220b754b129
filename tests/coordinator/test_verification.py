"""Verification through the real API: audit draws, audit states, verdicts and what a guilty one does."""

import pytest
from typer.testing import CliRunner

from gpuflex.auth.signing import node_id_for
from gpuflex.cli.main import app
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Node
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.ledger import accounts
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

from .ledger_checks import sound_totals

H0 = "ab" * 32
WINDOW_S = 15


@pytest.fixture
def coordinator(coordinator):
    coordinator.ctx.settings.audit_window_s = WINDOW_S
    return coordinator


def _spec(workers=2, rounds=2, audit_rate=1.0, slash=1.0) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "v",
            "resources": {"workers": workers},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
            "training": {"rounds": rounds, "verification": {"audit_rate": audit_rate, "slash": slash}},
        }
    )


def _commitment(segments=4) -> m.Commitment:
    return m.Commitment(
        seed=7,
        start="cd" * 32,
        data="ef" * 32,
        every=2,
        trace=[f"{i:016x}" for i in range(segments)],
        device="cpu",
    )


def _id(node) -> str:
    return node_id_for(node.key.public_key_hex)


class Net:
    """Alice's job on a core aggregator and community workers, round 0 published."""

    def __init__(self, coordinator, workers=2, **spec):
        self.c = coordinator
        self.alice = coordinator.consumer("alice", deposit=10)
        self.core = coordinator.node("core", core=True, price=0.4)
        self.nodes = [coordinator.node(f"c{i}", price=0.1 + i / 100) for i in range(workers)]
        for node in self.nodes:
            node.stake(2.0)
        self.job = self.alice.submit(_spec(workers, **spec), self.alice.upload(b"corpus " * 2000))
        self.agg_grant = self.core.lease()
        self.agg = coordinator.task(self.agg_grant)
        self.grants = [n.lease() for n in self.nodes]
        self.workers = [coordinator.task(g) for g in self.grants]
        self.agg.publish_round(m.RoundPublish(round=0, state_hash=H0, checkpoint=self.agg.put_blob(b"s0")))

    def contribute(self, i, round_=0, commitment=None) -> m.ContributionReceipt:
        delta = self.workers[i].put_blob(f"delta-{round_}-{i}".encode())
        return self.workers[i].submit_contribution(
            m.ContributionSubmit(
                round=round_, delta=delta, tokens=10, steps=8, train_loss=3.0, commitment=commitment
            )
        )

    def task_id(self, i) -> str:
        return self.grants[i].task_id

    def node_row(self, i) -> Node:
        with self.c.ctx.tx() as s:
            return s.get(Node, _id(self.nodes[i]))


def test_a_committed_contribution_is_drawn_and_only_its_segment_is_answered(coordinator):
    net = Net(coordinator)
    receipt = net.contribute(0, commitment=_commitment())
    assert receipt.accepted and receipt.audit_segment in range(4)
    assert net.contribute(0, commitment=_commitment()) == receipt  # a retry cannot re-roll the draw
    with pytest.raises(Conflict, match="final"):
        net.contribute(0, commitment=_commitment(segments=2))
    bare = net.contribute(1)
    assert bare.accepted and bare.audit_segment is None  # nothing committed: nothing to audit
    worker, segment = net.workers[0], receipt.audit_segment
    state = worker.put_blob(b"state at the segment")
    with pytest.raises(Conflict, match="was not drawn"):
        worker.submit_audit_state(m.AuditStateSubmit(round=0, segment=(segment + 1) % 4, state=state))
    with pytest.raises(BadRequest, match="upload it first"):
        worker.submit_audit_state(m.AuditStateSubmit(round=0, segment=segment, state="00" * 32))
    with pytest.raises(NotFound):
        worker.submit_audit_state(m.AuditStateSubmit(round=1, segment=segment, state=state))
    with pytest.raises(Conflict, match="not drawn for audit"):
        net.workers[1].submit_audit_state(m.AuditStateSubmit(round=0, segment=0, state=state))
    with pytest.raises(Forbidden):
        net.agg.submit_audit_state(m.AuditStateSubmit(round=0, segment=segment, state=state))
    for _ in range(2):  # a repeat is a no-op
        worker.submit_audit_state(m.AuditStateSubmit(round=0, segment=segment, state=state))
    listed = {c.task_id: c for c in net.agg.contributions(0).contributions}
    mine = listed[net.task_id(0)]
    assert (mine.commitment, mine.audit_segment, mine.audit_state) == (_commitment(), segment, state)
    assert listed[net.task_id(1)].commitment is None


def test_with_audit_rate_zero_nothing_is_drawn(coordinator):
    net = Net(coordinator, audit_rate=0.0)
    assert all(net.contribute(i, commitment=_commitment()).audit_segment is None for i in (0, 1))


def test_a_guilty_verdict_slashes_bars_the_node_and_the_task_goes_elsewhere(coordinator):
    net = Net(coordinator)
    spare = coordinator.node("spare", price=0.3)
    spare.stake(2.0)
    net.contribute(0)
    net.contribute(1)
    finding = m.VerdictSubmit(
        round=0,
        task_id=net.task_id(0),
        guilty=True,
        check="screen",
        reason="norm 40x the median",
        evidence={"norm_ratio": 40.0},
    )
    verdict = net.agg.http.request("POST", "/v1/task/verdicts", json=finding.model_dump()).json()
    verdict = m.Verdict.model_validate(verdict)
    assert (verdict.node_id, verdict.slashed, verdict.withheld) == (_id(net.nodes[0]), 1.0, 0.0)
    assert verdict.evidence["norm_ratio"] == 40.0 and "delta" in verdict.evidence
    net.agg.report_verdict(finding)  # idempotent: the same finding again changes nothing
    assert net.nodes[0].wallet().stake == 1.0
    assert (net.node_row(0).audits_failed, net.node_row(0).audits_passed) == (1, 0)
    assert [c.task_id for c in net.agg.contributions(0).contributions] == [net.task_id(1)]  # discarded
    with pytest.raises(Conflict, match="has ended"):
        net.workers[0].latest_round()  # its lease ended: the task subprocess must stop
    # The convicted node is the cheapest free node, yet the task goes to the spare, never back to it.
    coordinator.clock.advance(1)
    net.nodes[0].heartbeat([])
    assert net.nodes[0].lease() is None
    regrant = spare.lease()
    assert regrant.task_id == net.task_id(0) and regrant.epoch == net.grants[0].epoch + 1
    detail = net.alice.job(net.job.id)
    assert [v.reason for v in detail.verdicts] == ["norm 40x the median"]
    assert net.alice.verdicts(net.job.id) == detail.verdicts
    events = " ".join(e.message for e in net.alice.logs(net.job.id))
    assert "guilty (screen, round 0)" in events and "was found cheating" in events
    assert sound_totals(net.alice)[accounts.SLASHED] == 1_000_000


def test_a_verdict_after_the_job_ended_withholds_its_held_pay_and_honest_pay_is_released(coordinator):
    net = Net(coordinator, rounds=1)
    coordinator.clock.advance(10)
    for node, grant in zip((net.core, *net.nodes), (net.agg_grant, *net.grants), strict=True):
        node.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    receipts = [net.contribute(i, commitment=_commitment()) for i in (0, 1)]
    net.agg.publish_round(
        m.RoundPublish(
            round=1, state_hash=H0, update=net.agg.put_blob(b"u1"), checkpoint=net.agg.put_blob(b"s1")
        )
    )
    assert net.alice.job(net.job.id).state == "completed"
    held = net.nodes[0].wallet().held
    assert held > 0
    refund_before = net.alice.balance().balance
    # The audit came back after the job ended: one worker cheated, the other passed.
    for i, guilty in ((0, True), (1, False)):
        net.agg.report_verdict(
            m.VerdictSubmit(
                round=0,
                task_id=net.task_id(i),
                guilty=guilty,
                check="audit",
                reason=f"segment {receipts[i].audit_segment} " + ("diverged" if guilty else "reproduced"),
            )
        )
    (guilty, clean) = sorted(net.alice.verdicts(net.job.id), key=lambda v: not v.guilty)
    assert (guilty.slashed, guilty.withheld) == (1.0, pytest.approx(held))
    assert (clean.slashed, clean.withheld) == (0.0, 0.0)
    assert net.node_row(1).audits_passed == 1 and net.node_row(0).audits_failed == 1
    assert net.alice.balance().balance == pytest.approx(refund_before + held)
    coordinator.clock.advance(WINDOW_S + 1)
    reap_once(coordinator.ctx)
    assert net.nodes[0].wallet().earnings == 0 and net.nodes[1].wallet().earnings > 0
    sound_totals(net.alice)


def test_pay_of_a_node_convicted_while_the_job_ran_is_withheld_when_the_window_ends(coordinator):
    net = Net(coordinator, rounds=1)
    coordinator.clock.advance(10)
    for node, grant in zip((net.core, *net.nodes), (net.agg_grant, *net.grants), strict=True):
        node.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    net.contribute(0)
    net.agg.report_verdict(
        m.VerdictSubmit(round=0, task_id=net.task_id(0), guilty=True, check="screen", reason="nan update")
    )
    net.alice.cancel(net.job.id)  # settles: the convicted node's metered time is held like anyone's
    assert net.nodes[0].wallet().held > 0
    coordinator.clock.advance(WINDOW_S + 1)
    reap_once(coordinator.ctx)
    assert (net.nodes[0].wallet().earnings, net.nodes[0].wallet().held) == (0, 0)
    assert net.nodes[1].wallet().earnings > 0
    sound_totals(net.alice)


def test_verdicts_are_for_the_jobs_aggregator_and_its_owner_only(coordinator):
    net = Net(coordinator)
    net.contribute(0)
    finding = m.VerdictSubmit(round=0, task_id=net.task_id(0), guilty=True, check="screen", reason="x")
    with pytest.raises(Forbidden):
        net.workers[1].report_verdict(finding)  # a worker accusing a rival
    with pytest.raises(NotFound):
        net.agg.report_verdict(finding.model_copy(update={"task_id": "t-nothing"}))
    with pytest.raises(NotFound):
        net.agg.report_verdict(finding.model_copy(update={"round": 5}))
    with pytest.raises(Conflict, match="no longer"):
        net.agg.report_verdict(finding.model_copy(update={"evidence": {"delta": "00" * 32}}))
    with pytest.raises(BadRequest, match="deployment's auditors"):  # not an aggregator's to pass
        net.agg.report_verdict(finding.model_copy(update={"check": "inference-audit"}))
    net.agg.report_verdict(finding.model_copy(update={"guilty": False, "check": "audit"}))
    with pytest.raises(Conflict, match="already stands"):
        net.agg.report_verdict(finding.model_copy(update={"check": "audit"}))
    bob = coordinator.consumer("bob")
    with pytest.raises(NotFound):
        bob.verdicts(net.job.id)
    token = {"Authorization": f"Bearer {net.grants[1].task_token}"}
    for body in (
        {"round": 0},
        {**finding.model_dump(), "check": "vibes"},
        {**finding.model_dump(), "reason": ""},
    ):
        response = coordinator.http.post("/v1/task/verdicts", json=body, headers=token)
        assert response.status_code == 422, response.text
    assert coordinator.http.get(f"/v1/jobs/{net.job.id}/verdicts").status_code == 401
    assert [v.guilty for v in net.alice.verdicts(net.job.id)] == [False]


def test_job_show_prints_the_verdicts(coordinator):
    net = Net(coordinator)
    net.contribute(0)
    reason = "norm 40x the median"
    net.agg.report_verdict(
        m.VerdictSubmit(round=0, task_id=net.task_id(0), guilty=True, check="screen", reason=reason)
    )
    token = net.alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    result = CliRunner().invoke(
        app, ["job", "show", net.job.id, "--url", coordinator.url, "--token", token], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.output.splitlines() if net.task_id(0) in line and "guilty" in line]
    assert all(part in row for part in (_id(net.nodes[0]), "1.00")), row
    assert f"round 0, task {net.task_id(0)} (screen): {reason}" in result.output.splitlines()


def test_each_contribution_carries_the_residual_its_tasks_previous_contribution_left(coordinator):
    """What chains residuals: the aggregator learns from the coordinator, not from its own memory (it may
    have been replaced), which residual each contribution must start from."""
    net = Net(coordinator, rounds=4, audit_rate=0.0)

    def committed(round_, i):
        return _commitment().model_copy(update={"residual_out": f"{round_:08x}{i:08x}", "chain": round_})

    net.contribute(0, 0, committed(0, 0))
    net.contribute(1, 0)  # no commitment: nothing to chain to
    update = net.agg.put_blob(b"update-1")
    net.agg.publish_round(m.RoundPublish(round=1, state_hash=H0, update=update))
    net.contribute(1, 1, committed(1, 1))  # worker 0 misses round 1
    assert [(c.carried, c.carried_chain) for c in net.agg.contributions(1).contributions] == [(None, None)]
    update = net.agg.put_blob(b"update-2")
    net.agg.publish_round(m.RoundPublish(round=2, state_hash=H0, update=update))
    for i in (0, 1):
        net.contribute(i, 2, committed(2, i))
    carried = {c.task_id: (c.carried, c.carried_chain) for c in net.agg.contributions(2).contributions}
    assert carried == {net.task_id(0): ("00000000" * 2, 0), net.task_id(1): ("0000000100000001", 1)}
