"""The round protocol's state: contributions of workers and the global models the aggregator publishes.

Round ``r`` is open while ``r`` is the newest published round. Workers contribute a compressed
pseudo-gradient for it; the aggregator publishes round ``r + 1``, which closes ``r`` (a late
contribution is turned away, not lost silently). Publishing round ``rounds`` completes the job.
"""

from __future__ import annotations

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Contribution, Job, JobEvent, Lease, Node, Round, Task
from gpuflex.coordinator.services import dp, jobs, secure, specs, verification
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m
from gpuflex.storage import BlobStore


def _require_role(session: Session, lease: Lease, role: str) -> Task:
    task = session.get(Task, lease.task_id)
    if task.role != role:
        raise Forbidden(f"only the {role} of a job may do this")
    return task


def _state(job: Job, row: Round | None, now: float) -> m.RoundState:
    finished = job.state not in jobs.OPEN_JOB_STATES
    if row is None:
        return m.RoundState(round=-1, finished=finished)
    return m.RoundState(
        round=row.round,
        state_hash=row.state_hash,
        update=row.update,
        checkpoint=job.checkpoint,
        checkpoint_round=job.checkpoint_round,
        tokens=row.tokens,
        finished=finished,
        age_s=max(0.0, now - row.published_at),
    )


def latest(session: Session, lease: Lease, now: float) -> m.RoundState | None:
    """The newest published round; None while round 0 is awaited (a finished job always answers)."""
    job = session.get(Job, lease.job_id)
    row = session.get(Round, (job.id, job.round)) if job.round >= 0 else None
    if row is None and job.state in jobs.OPEN_JOB_STATES:
        return None
    return _state(job, row, now)


def get(session: Session, lease: Lease, round_: int, now: float) -> m.RoundState:
    """A published round, for a replica catching up update by update."""
    job = session.get(Job, lease.job_id)
    row = session.get(Round, (job.id, round_))
    if row is None:
        raise NotFound(f"round {round_} of job {job.id} is not published")
    return _state(job, row, now)


def contribute(
    session: Session, lease: Lease, msg: m.ContributionSubmit, blobs: BlobStore, now: float
) -> m.ContributionReceipt:
    """Record a worker's pseudo-gradient for the open round, and draw whether it is audited.

    One contribution per task and round. Not accepted if that round has closed. The same lease sending
    the same contribution again (a retry) gets the same receipt: it cannot re-roll its audit draw, nor
    change what it committed to. A new lease of the task (a replacement node) replaces what was there.
    """
    task = _require_role(session, lease, "worker")
    job = session.get(Job, lease.job_id)
    if job.state not in jobs.OPEN_JOB_STATES or msg.round < job.round:
        return m.ContributionReceipt(accepted=False)
    if msg.round > job.round:
        raise Conflict(f"round {msg.round} is not open; the newest is {job.round}")
    _check_blobs_exist(blobs, msg.delta)
    commitment = msg.commitment.model_dump(mode="json") if msg.commitment else None
    previous = session.scalars(
        select(Contribution).where(
            Contribution.job_id == job.id, Contribution.round == msg.round, Contribution.task_id == task.id
        )
    ).first()
    if previous is not None and previous.lease_id == lease.id:
        if (previous.delta, previous.commitment) != (msg.delta, commitment):
            raise Conflict(f"this lease already contributed to round {msg.round}; a contribution is final")
        return m.ContributionReceipt(accepted=True, audit_segment=previous.audit_segment)
    if previous is not None:
        # Older holders are fenced out by their tokens: the task's live lease speaks for it now (a
        # replacement node's work after the first holder was lost), and replaces what was there.
        session.delete(previous)
        session.flush()
    rate = specs.of(job).training.verification.audit_rate
    segment = verification.draw_audit(rate, msg.commitment)
    session.add(
        Contribution(
            job_id=job.id,
            round=msg.round,
            task_id=task.id,
            lease_id=lease.id,
            node_id=lease.node_id,
            delta=msg.delta,
            tokens=msg.tokens,
            steps=msg.steps,
            train_loss=msg.train_loss,
            created_at=now,
            commitment=commitment,
            audit_segment=segment,
        )
    )
    return m.ContributionReceipt(accepted=True, audit_segment=segment)


def contributions(session: Session, lease: Lease, round_: int, *, heard_since: float) -> m.ContributionList:
    """A round's contributions, and its quorum: what is in, plus what live workers still owe.

    Owed are contributions of workers that held their lease when the round was published. A worker
    whose node has not been heard from since ``heard_since`` (it missed a heartbeat) is not waited for:
    a dead node stalls a round for a heartbeat or two, not until it is declared lost. Nor is one that
    joined during the round (a replacement still starting up): it may make it in time, and otherwise
    contributes from the next round.
    """
    _require_role(session, lease, "aggregator")
    opened = session.get(Round, (lease.job_id, round_))
    rows = list(
        session.scalars(
            select(Contribution)
            .where(Contribution.job_id == lease.job_id, Contribution.round == round_)
            .order_by(Contribution.id)
        )
    )
    owing = session.scalar(
        select(func.count(Lease.id))
        .join(Task, Task.id == Lease.task_id)
        .join(Node, Node.id == Lease.node_id)
        .where(
            Lease.job_id == lease.job_id,
            Lease.state == "active",
            Task.role == "worker",
            Node.last_heartbeat_at >= heard_since,
            Lease.granted_at <= (opened.published_at if opened else float("inf")),
            Task.id.not_in([c.task_id for c in rows]),
        )
    )
    carried = _carried(session, lease.job_id, round_, [c.task_id for c in rows])
    return m.ContributionList(
        round=round_,
        contributions=[
            m.Contribution(
                task_id=c.task_id,
                node_id=c.node_id,
                delta=c.delta,
                tokens=c.tokens,
                steps=c.steps,
                train_loss=c.train_loss,
                commitment=c.commitment,
                audit_segment=c.audit_segment,
                audit_state=c.audit_state,
                carried=carried[c.task_id].residual_out if c.task_id in carried else None,
                carried_chain=carried[c.task_id].chain if c.task_id in carried else None,
            )
            for c in rows
        ],
        live_workers=len(rows) + (owing or 0),
    )


def _carried(session: Session, job_id: str, round_: int, tasks: list[str]) -> dict[str, m.Commitment]:
    """Each task's latest commitment before ``round_``: what ``Contribution.carried`` chains to.

    A convicted contribution is gone, but so is its node from the job: its task's next holder starts
    afresh, with an empty residual."""
    latest = (
        select(Contribution.task_id, func.max(Contribution.round).label("round"))
        .where(Contribution.job_id == job_id, Contribution.round < round_, Contribution.task_id.in_(tasks))
        .group_by(Contribution.task_id)
        .subquery()
    )
    rows = session.execute(
        select(Contribution.task_id, Contribution.commitment).join(
            latest,
            and_(
                Contribution.job_id == job_id,
                Contribution.task_id == latest.c.task_id,
                Contribution.round == latest.c.round,
            ),
        )
    )
    return {task: m.Commitment.model_validate(commitment) for task, commitment in rows if commitment}


def _check_blobs_exist(blobs: BlobStore, *digests: str | None) -> None:
    for digest in digests:
        if digest is not None and not blobs.exists(digest):
            raise BadRequest(f"blob {digest} is not in the blob store: upload it first")


def publish(
    session: Session, lease: Lease, msg: m.RoundPublish, blobs: BlobStore, now: float, *, fee_bps: int
) -> None:
    """Publish the next global model; the last round completes the job and settles it."""
    _require_role(session, lease, "aggregator")
    job = session.get(Job, lease.job_id, with_for_update=True)
    if job.state not in jobs.OPEN_JOB_STATES:
        raise Conflict(f"job {job.id} has ended ({job.state})")
    if msg.round != job.round + 1:
        raise Conflict(f"expected round {job.round + 1}, got {msg.round}")
    _check_blobs_exist(blobs, msg.update, msg.checkpoint)
    spec = specs.of(job)
    last = dp.last_round(spec)  # training.rounds, or fewer when privacy.dp's target allows fewer
    if msg.checkpoint is None and msg.round in (0, last):
        raise BadRequest(f"round {msg.round} must carry the full state (checkpoint)")
    if msg.update is None and msg.round > 0:
        raise BadRequest(f"round {msg.round} must carry its aggregated update")
    session.add(
        Round(
            job_id=job.id,
            round=msg.round,
            state_hash=msg.state_hash,
            update=msg.update,
            checkpoint=msg.checkpoint,
            tokens=msg.tokens,
            val_loss=msg.val_loss,
            train_loss=msg.train_loss,
            contributions=msg.contributions,
            published_at=now,
            epsilon=dp.epsilon(spec, msg.round),
        )
    )
    if msg.checkpoint is not None:
        job.checkpoint, job.checkpoint_round = msg.checkpoint, msg.round
    job.round = msg.round
    secure.discard(session, job.id, before=msg.round)
    job.val_loss = msg.val_loss
    job.train_loss = msg.train_loss
    if msg.round == 0:
        job.initial_val_loss = msg.val_loss
    losses = "".join(
        f", {which} loss {loss:.4f}"
        for which, loss in (("val", msg.val_loss), ("train", msg.train_loss))
        if loss is not None
    )
    # the job's one line per round: the aggregator does not log its own publishing
    session.add(
        JobEvent(
            job_id=job.id,
            at=now,
            message=f"round {msg.round} published ({msg.contributions} contributions{losses})",
        )
    )
    session.flush()
    if msg.round >= last:
        if stopped := dp.stopped(spec, msg.round):
            session.add(JobEvent(job_id=job.id, at=now, message=stopped))
        jobs.finish(session, job, "completed", "", now, fee_bps=fee_bps)
