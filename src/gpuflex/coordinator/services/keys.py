"""``privacy.encrypt``'s keys: the coordinator relays sealed data keys and never holds one it can open.

The consumer's CLI makes a job's data key, seals it to its own X25519 key and submits that copy with
the job (``jobs.sealed_key``): from it any machine holding the consumer's key can serve the job's keys.
A live lease of an encrypted job without a key (``leases.sealed_key`` None) is a key request: the
consumer's CLI (``gpuflex job keys``, ``submit --watch``, ``job watch``) checks the node's sealing key
against the node's own signature and seals the data key to it; only the node holding that lease, at
that epoch, gets it. A new epoch is a new lease, so a node that lost its lease has to be sealed to
again, and a lease that ended is refused. While no key comes (the consumer is offline), the node's
task waits and the job's log says so, once per lease: what to run, and that the lease's time is paid.
A wait is paid, so it is bounded: a task that waited longer than ``privacy.key_wait_s`` stops the job
(``overdue``), and the unspent budget goes back to the consumer.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, JobEvent, Lease, Node, Task
from gpuflex.coordinator.services import specs
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import BadRequest, Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m


def submitted(msg: m.JobSubmit) -> str | None:
    """The data key sealed to the consumer that an encrypted job is submitted with; None for any other."""
    if msg.spec.privacy.encrypt != (msg.sealed_key is not None):
        raise BadRequest(
            "privacy.encrypt: submit the job's data key sealed to your own key (`gpuflex submit` does), "
            "and only with privacy.encrypt"
        )
    return msg.sealed_key


def _encrypted(job: Job) -> str:
    if job.sealed_key is None:
        raise BadRequest(f"job {job.id} is not encrypted (privacy.encrypt): it has no keys")
    return job.sealed_key


def waits(session: Session, job: Job) -> list[str] | None:
    """An encrypted job's leased tasks still without their key, as ``job show`` lists them."""
    if job.sealed_key is None:
        return None
    return [f"{r.task} on {r.node_name}" for r in requests(session, job).requests]


def requests(session: Session, job: Job) -> m.JobKeys:
    """The job's sealed key and its live leases still waiting for theirs."""
    sealed = _encrypted(job)
    rows = session.execute(
        select(Lease.id, Lease.epoch, Task.role, Task.index, Node)
        .join(Task, Task.id == Lease.task_id)
        .join(Node, Node.id == Lease.node_id)
        .where(Lease.job_id == job.id, Lease.state == "active", Lease.sealed_key.is_(None))
        .order_by(Task.role, Task.index)
    )
    return m.JobKeys(
        job_id=job.id,
        sealed_key=sealed,
        open=job.state in OPEN_JOB_STATES,
        requests=[
            m.KeyRequest(
                lease_id=lease_id,
                epoch=epoch,
                task=f"{role} {index}",
                node_id=node.id,
                node_name=node.name,
                public_key=node.public_key,
                sealing_key=node.sealing_key,
                sealing_key_signature=node.sealing_key_signature,
            )
            for lease_id, epoch, role, index, node in rows
        ],
    )


def overdue(session: Session, jobs: Collection[Job], now: float) -> dict[str, str]:
    """Of ``jobs``, the encrypted ones with a leased task that waited past ``privacy.key_wait_s`` for its
    key, and why each must stop."""
    encrypted = {job.id: job for job in jobs if job.sealed_key is not None}
    if not encrypted:
        return {}
    waiting_since = session.execute(
        select(Lease.job_id, func.min(Lease.granted_at))
        .where(Lease.job_id.in_(encrypted), Lease.state == "active", Lease.sealed_key.is_(None))
        .group_by(Lease.job_id)
    )
    reasons = {}
    for job_id, since in waiting_since:
        limit = specs.of(encrypted[job_id]).privacy.key_wait_s
        if now - since > limit:
            reasons[job_id] = (
                f"a leased task waited {now - since:.0f}s for its data key (privacy.key_wait_s "
                f"{limit:.0f}s): the consumer's CLI served none (`gpuflex job keys {job_id}`), so the job "
                "stopped rather than pay for more waiting"
            )
    return reasons


def grant(session: Session, job: Job, msg: m.KeyGrant, now: float) -> None:
    """Hand the lease's node its sealed key: only to a live lease of this job, at its current epoch."""
    _encrypted(job)
    lease = session.get(Lease, msg.lease_id, with_for_update=True)
    if lease is None or lease.job_id != job.id:
        raise NotFound(f"job {job.id} has no lease {msg.lease_id}")
    if lease.epoch != msg.epoch or lease.state != "active":
        raise Conflict(f"lease {lease.id} at epoch {msg.epoch} is no longer live: its node gets no key")
    if lease.sealed_key is None:
        lease.sealed_key = msg.sealed_key
        message = f"data key sealed to {lease.node_id} (lease {lease.id}, epoch {lease.epoch})"
        session.add(JobEvent(job_id=job.id, at=now, message=message))


def for_lease(session: Session, node_id: str, lease_id: str, epoch: int, now: float) -> m.LeaseKey:
    """A node's sealed key for its live lease at ``epoch``; until the consumer sealed one, why not."""
    lease = session.get(Lease, lease_id)
    if lease is None:
        raise NotFound(f"no lease {lease_id}")
    if lease.node_id != node_id:
        raise Forbidden("this lease belongs to another node")
    if lease.epoch != epoch or lease.state != "active":
        raise Conflict(f"lease {lease_id} at epoch {epoch} is no longer live: no key for it")
    job = session.get(Job, lease.job_id)
    _encrypted(job)
    if lease.sealed_key is not None:
        return m.LeaseKey(sealed_key=lease.sealed_key)
    task = session.get(Task, lease.task_id)
    waiting = (
        f"{task.role} {task.index} on {node_id} waits for the consumer's data key (lease {lease.id}): the "
        f"consumer serves it with `gpuflex job keys {job.id}` (or `submit --watch`, `job watch`); the lease "
        f"is paid while it waits, for at most {specs.of(job).privacy.key_wait_s:.0f}s, and then the job stops"
    )
    told = select(JobEvent.at).where(JobEvent.job_id == job.id, JobEvent.message == waiting).limit(1)
    if session.scalar(told) is None:
        session.add(JobEvent(job_id=job.id, at=now, message=waiting))
    return m.LeaseKey(waiting=waiting)
