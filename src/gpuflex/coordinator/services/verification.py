"""Verification's consequences on the network: audit draws, audit states, peer audits, and verdicts.

The checks themselves (screening, re-executing a trace segment) run in the aggregator, on a trusted
core node (``gpuflex.train``); the coordinator keeps what workers commit to and what the aggregator
finds, and enforces it. The audit draw is the coordinator's, from a CSPRNG, made when a contribution
arrives: a worker can neither predict it nor re-roll it by resubmitting.

A guilty verdict, in one transaction: the contribution is discarded, the node's stake is slashed
``verification.slash`` credits (which also withholds its held pay for the job), its failed audits
count against its reputation, and it is barred from the job — its lease on the task ends and the
task is re-leased, never to that node again (``market.barred_nodes``). A verdict is recorded once per
(job, round, task, check); posting it again answers the first one. A verdict names the contribution
by task and round; ``evidence["delta"]``, when given, must still be that contribution's delta, so a
verdict on work a replacement node has since replaced never convicts the replacement.

Peer audits spare the core node's compute: the aggregator hands a drawn contribution's segments to
another worker of the job (the auditor, on another provider) and re-runs only where the auditor's
trace hashes disagree with the contribution's. One assignment per (job, round, task), and the
auditor's first report stands. A worker sees only the assignments still waiting for its own task,
never what anyone reported: an auditor shown another's hashes could copy them instead of re-running.
"""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Contribution, Job, JobEvent, Lease, Node, PeerAudit, Task, Verdict
from gpuflex.coordinator.services import leases, specs, stakes
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits, to_micro
from gpuflex.storage import BlobStore

_RATE_RESOLUTION = 1_000_000  # audit_rate is drawn against in millionths
EVIDENCE_ITEMS = 32  # what protocol.messages.Evidence holds at most


def draw_audit(audit_rate: float, commitment: m.Commitment | None) -> int | None:
    """The segment of ``commitment``'s trace to re-execute, with probability ``audit_rate``; else None.

    No commitment (or an empty trace) leaves nothing to audit.
    """
    if commitment is None or not commitment.trace or not drawn(audit_rate):
        return None
    return secrets.randbelow(len(commitment.trace))


def drawn(audit_rate: float) -> bool:
    """True with probability ``audit_rate``, from a CSPRNG (a contribution's audit, a served request's)."""
    return secrets.randbelow(_RATE_RESOLUTION) < round(audit_rate * _RATE_RESOLUTION)


def submit_audit_state(session: Session, lease: Lease, msg: m.AuditStateSubmit, blobs: BlobStore) -> None:
    """Take a worker's state for the segment drawn from its own contribution (a repeat is a no-op)."""
    task = session.get(Task, lease.task_id)
    if task.role != "worker":
        raise Forbidden("only a worker posts audit states")
    row = session.scalars(
        select(Contribution)
        .where(
            Contribution.job_id == lease.job_id,
            Contribution.round == msg.round,
            Contribution.task_id == task.id,
            Contribution.lease_id == lease.id,
        )
        .with_for_update()
    ).first()
    if row is None:
        raise NotFound(f"this lease made no contribution to round {msg.round}")
    if row.audit_segment is None:
        raise Conflict(f"the contribution to round {msg.round} was not drawn for audit")
    if msg.segment != row.audit_segment:
        raise Conflict(f"segment {msg.segment} was not drawn: the audit asks for segment {row.audit_segment}")
    if row.audit_state is not None and row.audit_state != msg.state:
        raise Conflict(f"the audit state of round {msg.round} was already posted ({row.audit_state})")
    if not blobs.exists(msg.state):
        raise BadRequest(f"blob {msg.state} is not in the blob store: upload it first")
    row.audit_state = msg.state


def assign_peer_audit(
    session: Session, lease: Lease, msg: m.PeerAuditAssign, blobs: BlobStore, now: float
) -> None:
    """Hand a drawn contribution's segments to another worker of the job (the same again is a no-op)."""
    job = _aggregated_by(session, lease)
    contribution = _contribution(session, job.id, msg.round, msg.task_id)
    if contribution.audit_segment is None:
        raise Conflict(f"the contribution of {msg.task_id} to round {msg.round} was not drawn for audit")
    if msg.auditor == msg.task_id:
        raise BadRequest(f"task {msg.task_id} cannot audit its own contribution: name another worker")
    auditor = session.get(Task, msg.auditor)
    if auditor is None or auditor.job_id != job.id or auditor.role != "worker":
        raise BadRequest(f"the auditor {msg.auditor} is not a worker of job {job.id}")
    existing = session.get(PeerAudit, (job.id, msg.round, msg.task_id))
    if existing is not None:
        assigned = (existing.auditor_task_id, existing.worker, existing.segment, existing.state)
        if assigned != (msg.auditor, msg.worker, msg.segment, msg.state):
            raise Conflict(f"round {msg.round} of {msg.task_id} is already assigned to {assigned[0]}")
        return
    if not blobs.exists(msg.state):
        raise BadRequest(f"blob {msg.state} is not in the blob store: upload it first")
    session.add(
        PeerAudit(
            job_id=job.id,
            round=msg.round,
            task_id=msg.task_id,
            auditor_task_id=msg.auditor,
            worker=msg.worker,
            segment=msg.segment,
            state=msg.state,
            created_at=now,
        )
    )


def peer_audits(session: Session, lease: Lease, round_: int | None) -> m.PeerAuditList:
    """The aggregator's view: every assignment of its job, with what was reported. A worker's: only
    those still waiting for its own task. Of ``round_`` if given; by round, then audited task."""
    query = select(PeerAudit).where(PeerAudit.job_id == lease.job_id)
    if session.get(Task, lease.task_id).role != "aggregator":
        query = query.where(PeerAudit.auditor_task_id == lease.task_id, PeerAudit.reported_at.is_(None))
    if round_ is not None:
        query = query.where(PeerAudit.round == round_)
    rows = session.scalars(query.order_by(PeerAudit.round, PeerAudit.task_id))
    return m.PeerAuditList(audits=[_peer_audit_view(row) for row in rows])


def report_peer_audit(session: Session, lease: Lease, msg: m.PeerAuditReport, now: float) -> None:
    """Take the auditor's trace hashes for what it re-ran; its first report stands (the same is a no-op)."""
    row = session.get(PeerAudit, (lease.job_id, msg.round, msg.task_id), with_for_update=True)
    if row is None:
        raise NotFound(f"no peer audit of task {msg.task_id} in round {msg.round} of job {lease.job_id}")
    if row.auditor_task_id != lease.task_id:
        raise Forbidden(f"the peer audit of {msg.task_id} in round {msg.round} was assigned to another task")
    if row.hashes is not None:
        if row.hashes != msg.hashes:
            raise Conflict(f"the peer audit of {msg.task_id} in round {msg.round} was already reported")
        return
    row.hashes, row.reported_at = list(msg.hashes), now


def _peer_audit_view(row: PeerAudit) -> m.PeerAudit:
    return m.PeerAudit(
        round=row.round,
        task_id=row.task_id,
        auditor=row.auditor_task_id,
        worker=row.worker,
        segment=row.segment,
        state=row.state,
        hashes=row.hashes,
    )


def record(session: Session, lease: Lease, msg: m.VerdictSubmit, now: float) -> m.Verdict:
    """Record the aggregator's verdict on a contribution of its job, and carry out what it entails."""
    if msg.check == "inference-audit":
        raise BadRequest("inference-audit verdicts come from a deployment's auditors, not an aggregator")
    job = _aggregated_by(session, lease)
    existing = session.scalars(
        select(Verdict).where(
            Verdict.job_id == job.id,
            Verdict.round == msg.round,
            Verdict.task_id == msg.task_id,
            Verdict.check == msg.check,
        )
    ).first()
    if existing is not None:
        if existing.guilty != msg.guilty:
            raise Conflict(f"a {msg.check} verdict on round {msg.round} of {msg.task_id} already stands")
        return view(existing)
    contribution = _contribution(session, job.id, msg.round, msg.task_id)
    judged = msg.evidence.get("delta")
    if judged is not None and judged != contribution.delta:
        # The task's new holder replaced the contribution judged: the verdict is not about its node.
        raise Conflict(f"the contribution of {msg.task_id} to round {msg.round} is no longer {judged}")
    node = session.get(Node, contribution.node_id, with_for_update=True)
    evidence = dict(msg.evidence)
    if len(evidence) < EVIDENCE_ITEMS:
        evidence.setdefault("delta", contribution.delta)  # what was judged, by its hash
    verdict = Verdict(
        job_id=job.id,
        round=msg.round,
        task_id=msg.task_id,
        node_id=node.id,
        guilty=msg.guilty,
        check=msg.check,
        reason=msg.reason,
        evidence=evidence,
        slashed_micro=0,
        withheld_micro=0,
        at=now,
    )
    if msg.guilty:
        _convict(session, job, contribution, node, verdict, now)
    elif msg.check in ("audit", "peer-audit", "dispute"):  # its work was re-run, and stood
        node.audits_passed += 1
    session.add(verdict)
    session.flush()
    return view(verdict)


def _aggregated_by(session: Session, lease: Lease) -> Job:
    """The job whose aggregator holds ``lease``, on a core node (the only ones trusted to judge), locked."""
    if session.get(Task, lease.task_id).role != "aggregator":
        raise Forbidden("only the aggregator of a job judges its contributions")
    if session.get(Node, lease.node_id).kind != "core":
        raise Forbidden("only an aggregator on a core node judges contributions")
    return session.get(Job, lease.job_id, with_for_update=True)


def _convict(
    session: Session, job: Job, contribution: Contribution, node: Node, verdict: Verdict, now: float
) -> None:
    """Discard the contribution, then ``convict`` its node."""
    amount = to_micro(specs.of(job).training.verification.slash)
    session.delete(contribution)
    convict(session, job, contribution.task_id, node, verdict, amount, f"round {verdict.round}", now)


def convict(
    session: Session,
    job: Job,
    task_id: str,
    node: Node,
    verdict: Verdict,
    amount_micro: int,
    what: str,
    now: float,
) -> None:
    """Slash ``node`` for ``verdict`` (its held pay withheld), count the failure, and bar it from the job:
    its lease on ``task_id`` ends and the task is placed again elsewhere. ``what``: the work judged, in
    words (``round 3``, ``audit 12``). Training's verdicts and a deployment's inference audits share it."""
    noun = "deployment" if job.kind == "deployment" else "job"
    evidence = f"{verdict.check} verdict on {what} of {noun} {job.id}: {verdict.reason}"
    slash = stakes.slash(session, node.id, amount_micro, evidence, now, job_id=job.id)
    verdict.slashed_micro, verdict.withheld_micro = slash.amount_micro, slash.withheld_micro
    node.audits_failed += 1
    message = (
        f"verdict: {node.name} ({node.id}) guilty ({verdict.check}, {what}): "
        f"{verdict.reason}; slashed {to_credits(slash.amount_micro):.6f} credits; barred from the {noun}"
    )
    session.add(JobEvent(job_id=job.id, at=now, message=message))
    leases.end_by_verdict(session, task_id, node.id, now)


def for_job(session: Session, job: Job) -> list[m.Verdict]:
    """A job's verdicts, newest first."""
    rows = session.scalars(select(Verdict).where(Verdict.job_id == job.id).order_by(Verdict.id.desc()))
    return [view(v) for v in rows]


def view(row: Verdict) -> m.Verdict:
    return m.Verdict(
        round=row.round,
        task_id=row.task_id,
        guilty=row.guilty,
        check=row.check,
        reason=row.reason,
        evidence=row.evidence,
        node_id=row.node_id,
        at=row.at,
        slashed=to_credits(row.slashed_micro),
        withheld=to_credits(row.withheld_micro),
    )


def _contribution(session: Session, job_id: str, round_: int, task_id: str) -> Contribution:
    contribution = session.scalars(
        select(Contribution).where(
            Contribution.job_id == job_id, Contribution.round == round_, Contribution.task_id == task_id
        )
    ).first()
    if contribution is None:
        raise NotFound(f"no contribution of task {task_id} to round {round_} of job {job_id}")
    return contribution
