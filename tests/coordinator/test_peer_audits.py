"""Peer audits through the real API: the aggregator hands a drawn contribution to another worker of the
job, which alone is shown the order and reports its trace hashes; the aggregator then reads them."""

import pytest
from sqlalchemy import select

from gpuflex.coordinator.db import Task
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m

from .test_verification import Net, _commitment, _spec

HASHES = ["0123456789abcdef", "fedcba9876543210"]


class Peers(Net):
    """Three workers: 0's contribution is drawn for audit, 1's is not (no commitment), 2 made none."""

    def __init__(self, coordinator):
        super().__init__(coordinator, workers=3)
        self.segment = self.contribute(0, commitment=_commitment()).audit_segment
        assert self.segment is not None, "audit_rate 1.0 draws every committed contribution"
        assert self.contribute(1).audit_segment is None
        self.order = self.agg.put_blob(b"state at the segment and its learning rates")

    def assignment(self, **update) -> m.PeerAuditAssign:
        """Worker 1 re-runs worker 0's drawn segment, unless ``update`` says otherwise."""
        order = m.PeerAuditAssign(
            round=0,
            task_id=self.task_id(0),
            auditor=self.task_id(1),
            worker=0,
            segment=self.segment,
            state=self.order,
        )
        return order.model_copy(update=update)

    def report(self, **update) -> m.PeerAuditReport:
        return m.PeerAuditReport(round=0, task_id=self.task_id(0), hashes=HASHES).model_copy(update=update)


@pytest.fixture
def net(coordinator) -> Peers:
    return Peers(coordinator)


def test_the_auditor_alone_is_shown_its_order_and_the_aggregator_reads_what_it_reported(net):
    order = net.assignment()
    net.agg.assign_peer_audit(order)
    assigned = m.PeerAudit(**order.model_dump())
    assert net.agg.peer_audits().audits == [assigned]
    auditor = net.workers[1]
    assert auditor.peer_audits().audits == [assigned]
    assert auditor.peer_audits(round=0).audits == [assigned]
    assert auditor.peer_audits(round=1).audits == []
    assert net.workers[0].peer_audits().audits == []  # the audited worker is not told
    assert net.workers[2].peer_audits().audits == []  # nor is a bystander

    auditor.report_peer_audit(net.report())
    assert auditor.peer_audits().audits == []  # done: its poll no longer shows it
    reported = assigned.model_copy(update={"hashes": HASHES})
    assert net.agg.peer_audits().audits == [reported]
    assert net.agg.peer_audits(round=0).audits == [reported]
    assert net.agg.peer_audits(round=1).audits == []
    assert net.workers[0].peer_audits().audits == net.workers[2].peer_audits().audits == []


def test_a_worker_sees_its_own_orders_in_round_then_task_order(net):
    net.contribute(2, commitment=_commitment())
    orders = [net.assignment(auditor=net.task_id(2)), net.assignment(task_id=net.task_id(2))]
    orders.sort(key=lambda o: o.task_id)
    for order in reversed(orders):  # assigned out of order: the listing sorts them
        net.agg.assign_peer_audit(order)
    assert net.agg.peer_audits().audits == [m.PeerAudit(**o.model_dump()) for o in orders]
    assert [a.task_id for a in net.workers[1].peer_audits().audits] == [net.task_id(2)]
    assert [a.task_id for a in net.workers[2].peer_audits().audits] == [net.task_id(0)]


def test_only_the_jobs_aggregator_assigns_and_only_the_auditor_reports(net):
    with pytest.raises(Forbidden, match="aggregator"):
        net.workers[1].assign_peer_audit(net.assignment())  # a worker choosing its own audit
    with pytest.raises(NotFound, match="no peer audit"):
        net.workers[1].report_peer_audit(net.report())  # nothing assigned yet
    net.agg.assign_peer_audit(net.assignment())
    for caller in (net.workers[0], net.workers[2], net.agg):  # the audited worker, a bystander, the judge
        with pytest.raises(Forbidden, match="another task"):
            caller.report_peer_audit(net.report())
    with pytest.raises(NotFound):
        net.workers[1].report_peer_audit(net.report(round=1))
    assert [a.hashes for a in net.agg.peer_audits().audits] == [None]


def test_an_assignment_names_a_drawn_contribution_another_worker_of_the_job_and_an_uploaded_state(net):
    other = net.alice.submit(_spec(), net.alice.upload(b"other corpus " * 1000))
    with net.c.ctx.tx() as s:
        stranger = s.scalars(select(Task.id).where(Task.job_id == other.id, Task.role == "worker")).first()
    assert stranger is not None
    with pytest.raises(Conflict, match="not drawn for audit"):
        net.agg.assign_peer_audit(net.assignment(task_id=net.task_id(1), auditor=net.task_id(2)))
    with pytest.raises(NotFound, match="no contribution"):
        net.agg.assign_peer_audit(net.assignment(task_id=net.task_id(2)))
    with pytest.raises(NotFound, match="no contribution"):
        net.agg.assign_peer_audit(net.assignment(round=1))
    with pytest.raises(BadRequest, match="its own contribution"):
        net.agg.assign_peer_audit(net.assignment(auditor=net.task_id(0)))
    for auditor in (net.agg_grant.task_id, stranger, "t-nothing"):
        with pytest.raises(BadRequest, match="not a worker of job"):
            net.agg.assign_peer_audit(net.assignment(auditor=auditor))
    with pytest.raises(BadRequest, match="upload it first"):
        net.agg.assign_peer_audit(net.assignment(state="00" * 32))
    assert net.agg.peer_audits().audits == []  # none of them was stored


def test_repeats_are_no_ops_and_conflicting_repeats_are_refused(net):
    order = net.assignment()
    for _ in range(2):
        net.agg.assign_peer_audit(order)
    another_state = net.agg.put_blob(b"another state")
    for update in ({"auditor": net.task_id(2)}, {"state": another_state}, {"segment": 9}):
        with pytest.raises(Conflict, match="already assigned"):
            net.agg.assign_peer_audit(net.assignment(**update))
    auditor = net.workers[1]
    for _ in range(2):
        auditor.report_peer_audit(net.report())
    with pytest.raises(Conflict, match="already reported"):
        auditor.report_peer_audit(net.report(hashes=HASHES[:1]))
    net.agg.assign_peer_audit(order)  # still the same assignment once reported
    assert net.agg.peer_audits().audits == [m.PeerAudit(**order.model_dump(), hashes=HASHES)]


def test_malformed_peer_audit_calls_are_refused_with_422(net, coordinator):
    token = {"Authorization": f"Bearer {net.grants[1].task_token}"}
    bad_hashes = {**net.report().model_dump(), "hashes": ["not hex"]}
    response = coordinator.http.post("/v1/task/peer-audits/report", json=bad_hashes, headers=token)
    assert response.status_code == 422, response.text
    response = coordinator.http.get("/v1/task/peer-audits", params={"round": -1}, headers=token)
    assert response.status_code == 422, response.text
    response = coordinator.http.get("/v1/task/peer-audits", headers=token)
    assert (response.status_code, response.json()) == (200, {"audits": []})


@pytest.mark.parametrize(
    ("check", "guilty", "passed", "failed"),
    [("peer-audit", False, 1, 0), ("dispute", False, 1, 0), ("dispute", True, 0, 1)],
)
def test_a_peer_audit_or_a_dispute_counts_in_the_node_s_audit_record(net, check, guilty, passed, failed):
    net.agg.report_verdict(
        m.VerdictSubmit(round=0, task_id=net.task_id(0), guilty=guilty, check=check, reason="re-run")
    )
    assert (net.node_row(0).audits_passed, net.node_row(0).audits_failed) == (passed, failed)
