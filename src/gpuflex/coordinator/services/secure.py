"""A federated job's secure aggregation on the coordinator: its threshold checked at submit (before the
budget moves), and the relay of its rounds' messages between the job's tasks (``privacy.mailbox``'s
rules; ``train.secure`` plays the protocol). The coordinator stores sealed share bundles and, for the
aggregator alone, the survivors' reveals; it never sees a masking key or an unmasked update. A round's
messages are kept only until the round they aggregate is published (``discard``)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, Lease, Task
from gpuflex.coordinator.db import SecAggMessage as Row
from gpuflex.coordinator.services import specs
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import Conflict, Forbidden, SpecError
from gpuflex.privacy import mailbox, secagg
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec


def threshold(spec: JobSpec) -> int | None:
    """The job's threshold (None without secure aggregation); SpecError for too few owners for it."""
    privacy = spec.privacy
    if not privacy.secure_aggregation:
        return None
    owners = spec.resources.workers
    try:
        return secagg.job_threshold(owners, privacy.secagg_threshold)
    except SpecError as err:
        raise SpecError(f"privacy.secure_aggregation with {owners} owner(s) of the data: {err}") from None


def post(session: Session, lease: Lease, msg: m.SecAggPost, now: float) -> None:
    job = session.get(
        Job, lease.job_id, with_for_update=True
    )  # one job's posts in turn: the rules read them all
    if threshold(specs.of(job)) is None:
        raise Forbidden("this job does not use secure aggregation")
    if job.state not in OPEN_JOB_STATES or msg.round != job.round:
        raise Conflict(f"round {msg.round} is not open; the newest is {job.round}")
    role = session.get(Task, lease.task_id).role
    if mailbox.check_post(_read(session, job.id, msg.round), msg, lease.task_id, role == "aggregator"):
        session.add(
            Row(
                job_id=job.id,
                round=msg.round,
                attempt=msg.attempt,
                kind=msg.kind,
                sender=lease.task_id,
                recipient=msg.to,
                body=msg.body,
                created_at=now,
            )
        )


def messages(session: Session, lease: Lease, round_: int, after: int = -1) -> m.SecAggList:
    """What the task may read of ``round_`` after ``seq`` ``after``. The seqs are row ids, inserted under
    the job's row lock (``post``): a job's messages commit in seq order, so a reader never skips one."""
    is_aggregator = session.get(Task, lease.task_id).role == "aggregator"
    rows = _read(session, lease.job_id, round_, after)
    return m.SecAggList(messages=[x for x in rows if mailbox.visible(x, lease.task_id, is_aggregator)])


def _read(session: Session, job_id: str, round_: int, after: int = -1) -> list[m.SecAggMessage]:
    query = select(Row).where(Row.job_id == job_id, Row.round == round_, Row.id > after)
    return [
        m.SecAggMessage(
            round=r.round,
            attempt=r.attempt,
            kind=r.kind,
            to=r.recipient,
            body=r.body,
            sender=r.sender,
            seq=r.id,
        )
        for r in session.scalars(query.order_by(Row.id))
    ]


def discard(session: Session, job_id: str, before: int | None = None) -> None:
    """Delete the job's messages of rounds before ``before`` (all of them when None): a round's messages
    serve only the aggregation that publishes the next, and nothing reads them after."""
    query = delete(Row).where(Row.job_id == job_id)
    if before is not None:
        query = query.where(Row.round < before)
    session.execute(query)
