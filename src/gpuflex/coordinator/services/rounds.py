"""The round protocol's state: contributions of workers and the global models the aggregator publishes.

Round ``r`` is open while ``r`` is the newest published round. Workers contribute a compressed
pseudo-gradient for it; the aggregator publishes round ``r + 1``, which closes ``r`` (a late
contribution is turned away, not lost silently). Publishing round ``rounds`` completes the job.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Contribution, Job, JobEvent, Lease, Round, Task
from gpuflex.coordinator.services import jobs
from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage import BlobStore


def _require_role(session: Session, lease: Lease, role: str) -> Task:
    task = session.get(Task, lease.task_id)
    if task.role != role:
        raise Forbidden(f"only the {role} of a job may do this")
    return task


def latest(session: Session, lease: Lease) -> m.RoundState | None:
    job = session.get(Job, lease.job_id)
    finished = job.state not in jobs.OPEN_JOB_STATES
    if job.round < 0:
        return m.RoundState(round=-1, model=None, finished=True) if finished else None
    newest = session.get(Round, (job.id, job.round))
    return m.RoundState(round=job.round, model=newest.model, finished=finished)


def contribute(
    session: Session, lease: Lease, msg: m.ContributionSubmit, blobs: BlobStore, now: float
) -> bool:
    """Record a worker's pseudo-gradient for the open round; False if that round has closed.

    One contribution per task and round: a second one from the task's live lease replaces the first.
    """
    task = _require_role(session, lease, "worker")
    job = session.get(Job, lease.job_id)
    if job.state not in jobs.OPEN_JOB_STATES or msg.round < job.round:
        return False
    if msg.round > job.round:
        raise Conflict(f"round {msg.round} is not open; the newest is {job.round}")
    if not blobs.exists(msg.delta):
        raise BadRequest(f"blob {msg.delta} is not in the blob store: upload it first")
    previous = session.scalars(
        select(Contribution).where(
            Contribution.job_id == job.id, Contribution.round == msg.round, Contribution.task_id == task.id
        )
    ).first()
    if previous is not None:
        # The task's live lease speaks for it (older holders are fenced out by their tokens): a retry,
        # or a replacement node's work after the first holder was lost, replaces what was there.
        session.delete(previous)
        session.flush()
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
        )
    )
    return True


def contributions(session: Session, lease: Lease, round_: int) -> m.ContributionList:
    _require_role(session, lease, "aggregator")
    rows = session.scalars(
        select(Contribution)
        .where(Contribution.job_id == lease.job_id, Contribution.round == round_)
        .order_by(Contribution.id)
    )
    live = session.scalar(
        select(func.count(Lease.id))
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.job_id == lease.job_id, Lease.state == "active", Task.role == "worker")
    )
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
            )
            for c in rows
        ],
        live_workers=live or 0,
    )


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
    if not blobs.exists(msg.model):
        raise BadRequest(f"blob {msg.model} is not in the blob store: upload it first")
    session.add(
        Round(
            job_id=job.id,
            round=msg.round,
            model=msg.model,
            val_loss=msg.val_loss,
            train_loss=msg.train_loss,
            contributions=msg.contributions,
            published_at=now,
        )
    )
    job.round = msg.round
    job.val_loss = msg.val_loss
    job.train_loss = msg.train_loss
    if msg.round == 0:
        job.initial_val_loss = msg.val_loss
    loss = f", val loss {msg.val_loss:.4f}" if msg.val_loss is not None else ""
    session.add(
        JobEvent(
            job_id=job.id,
            at=now,
            message=f"round {msg.round} published ({msg.contributions} contributions{loss})",
        )
    )
    session.flush()
    if msg.round >= JobSpec.model_validate(job.spec).training.rounds:
        jobs.finish(session, job, "completed", "", now, fee_bps=fee_bps)
