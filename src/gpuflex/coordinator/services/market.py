"""Placement: which online node runs each pending task of a job, and why.

The ranking itself is the pure ``gpuflex.market.matching`` (shared with the simulator); this
module turns database rows into offers and records each choice with its reason (on the task and in
the job's log), and likewise why a worker waits when the job's own core rules (``min_core_workers``,
``core_fallback``) hold it back. A node runs one task at a time: a node holding a live lease, or
chosen for a pending task, is busy.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, JobEvent, Lease, Node, Task, try_lock
from gpuflex.coordinator.services import ledger
from gpuflex.ledger import accounts
from gpuflex.market.matching import Choice, NodeOffer, Requirements, place_aggregator, place_workers
from gpuflex.protocol.money import to_credits
from gpuflex.protocol.spec import JobSpec

OPEN_JOB_STATES = ("pending", "scheduled", "running")
_PLACEMENT_LOCK_KEY = 0x6770_6C63  # "gplc"


def offer_of(node: Node) -> NodeOffer:
    gpus = tuple(g["name"] for g in node.hardware.get("gpus", []))
    return NodeOffer(
        node_id=node.id,
        name=node.name,
        kind=node.kind,
        price_per_hour=to_credits(node.price_micro),
        tflops=node.tflops,
        vram_gb=node.vram_gb,
        gpus=gpus,
        region=node.region,
    )


def busy_nodes(session: Session) -> set[str]:
    leased = session.scalars(select(Lease.node_id).where(Lease.state == "active"))
    placed = session.scalars(select(Task.node_id).where(Task.state == "pending", Task.node_id.is_not(None)))
    return {n for n in (*leased, *placed) if n}


def unplace_from_gone_nodes(session: Session) -> None:
    """A task placed on a node that went away before leasing it goes back to the market."""
    gone = select(Node.id).where(Node.state != "online")
    session.execute(
        update(Task)
        .where(Task.state == "pending", Task.node_id.in_(gone))
        .values(node_id=None, placement="")
        .execution_options(synchronize_session=False)
    )


def place_pending(session: Session, now: float, *, min_stake: int = 0) -> int:
    """Place every unplaced pending task on a free, qualifying node; returns how many were placed.

    A community node qualifies only with at least ``min_stake`` micro-credits staked; core nodes
    are the operator's own and stake nothing.

    Placement reads the whole market, so one coordinator replica places at a time; another that
    finds the lock taken skips its turn (the holder is placing the same tasks).
    """
    if not try_lock(session, _PLACEMENT_LOCK_KEY):
        return 0
    unplace_from_gone_nodes(session)
    unplaced = list(
        session.scalars(
            select(Task)
            .join(Job, Job.id == Task.job_id)
            .where(Task.state == "pending", Task.node_id.is_(None), Job.state.in_(OPEN_JOB_STATES))
            .order_by(Job.created_at, Task.role, Task.index)
        )
    )
    if not unplaced:
        return 0
    offers = [offer_of(n) for n in session.scalars(select(Node).where(Node.state == "online"))]
    if min_stake > 0:
        bonded = ledger.balances_under(session, accounts.STAKES)
        offers = [o for o in offers if o.kind == "core" or bonded.get(o.node_id, 0) >= min_stake]
    busy = busy_nodes(session)
    placed = 0
    for job_id in dict.fromkeys(t.job_id for t in unplaced):
        job = session.get(Job, job_id)
        req = Requirements.from_spec(JobSpec.model_validate(job.spec))
        tasks = [t for t in unplaced if t.job_id == job_id]
        placed += _place_job_tasks(session, job, req, tasks, offers, busy, now)
    return placed


def _place_job_tasks(
    session: Session,
    job: Job,
    req: Requirements,
    tasks: list[Task],
    offers: list[NodeOffer],
    busy: set[str],
    now: float,
) -> int:
    choices: list[tuple[Task, Choice]] = []
    for task in (t for t in tasks if t.role == "aggregator"):
        choice = place_aggregator(req, offers, exclude=busy)
        if choice:
            choices.append((task, choice))
            busy.add(choice.node_id)
    workers = [t for t in tasks if t.role == "worker"]
    waiting: list[Task] = []
    wait_reason = None
    if workers:
        core_already = _workers_on_core(session, job.id)
        placement = place_workers(req, offers, count=len(workers), exclude=busy, core_already=core_already)
        choices.extend(zip(workers, placement.choices, strict=False))
        busy.update(c.node_id for c in placement.choices)
        waiting, wait_reason = workers[len(placement.choices) :], placement.wait_reason
    for task, choice in choices:
        task.node_id, task.placement = choice.node_id, choice.reason
        session.add(
            JobEvent(
                job_id=job.id,
                at=now,
                message=f"{task.role} {task.index} placed on {choice.node_id}: {choice.reason}",
            )
        )
    _note_waiting(session, job.id, waiting, wait_reason, now)
    if job.state == "pending" and choices and _all_placed(session, job):
        job.state = "scheduled"
    return len(choices)


def _workers_on_core(session: Session, job_id: str) -> int:
    """The job's workers placed on or leased by core nodes: they count toward its core quota."""
    return session.scalar(
        select(func.count(Task.id))
        .join(Node, Node.id == Task.node_id)
        .where(
            Task.job_id == job_id,
            Task.role == "worker",
            Task.state.in_(("pending", "leased")),
            Node.kind == "core",
        )
    )


def _note_waiting(session: Session, job_id: str, waiting: list[Task], reason: str | None, now: float) -> None:
    """Keep on each waiting worker's task why it waits (``gpuflex job show``) and tell the job's log
    when that changes: placement runs on every reaper pass, and the log needs the news once."""
    note = f"waits: {reason}" if reason else ""
    changed = [t for t in waiting if t.placement != note]
    for task in changed:
        task.placement = note
    if note and changed:
        indexes = ", ".join(str(t.index) for t in waiting)
        who = f"worker {indexes} waits" if len(waiting) == 1 else f"workers {indexes} wait"
        session.add(JobEvent(job_id=job_id, at=now, message=f"{who}: {reason}"))


def _all_placed(session: Session, job: Job) -> bool:
    unplaced = session.scalars(
        select(Task.id).where(Task.job_id == job.id, Task.state == "pending", Task.node_id.is_(None))
    ).first()
    return unplaced is None
