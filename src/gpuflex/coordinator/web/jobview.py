"""One job as its page shows it: the job's detail, workers per round, traffic, and its event timeline.

Every function takes a job its caller already got through ``services.jobs.owned``; nothing here
looks a job up by id, so a page can't show somebody else's job.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Contribution, Job, Lease, Node, Task
from gpuflex.coordinator.services import jobs
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.stats import Traffic
from gpuflex.coordinator.web.traffic import job_traffic
from gpuflex.protocol import messages as m

ROUNDS_SHOWN = 8
EVENTS_SHOWN = 200


@dataclass(frozen=True)
class Cell:
    """One worker in one round: contributed, guilty (convicted: its contribution was discarded),
    training (open round), waiting (no node), unplaced (it never ran) or missed."""

    state: str
    node: str | None = None
    train_loss: float | None = None
    steps: int = 0


@dataclass(frozen=True)
class RoundRow:
    round: int
    open: bool
    val_loss: float | None
    cells: list[Cell]


@dataclass(frozen=True)
class TaskRow:
    role: str
    index: int
    state: str
    node: str | None
    node_id: str | None
    epoch: int
    placement: str


@dataclass(frozen=True)
class JobPage:
    job: m.JobDetail
    tasks: list[TaskRow]
    workers: int
    rounds: list[RoundRow]
    traffic: Traffic
    events: list[m.JobEvent]

    @property
    def spend_fraction(self) -> float:
        return min(1.0, self.job.spent / self.job.budget) if self.job.budget else 0.0


def _names(session: Session, node_ids: set[str]) -> dict[str, str]:
    if not node_ids:
        return {}
    return dict(session.execute(select(Node.id, Node.name).where(Node.id.in_(node_ids))).all())


def _tasks(session: Session, job: Job) -> list[Task]:
    return list(session.scalars(select(Task).where(Task.job_id == job.id).order_by(Task.role, Task.index)))


def _rounds(session: Session, job: Job, workers: list[Task], detail: m.JobDetail) -> list[RoundRow]:
    """The newest rounds, newest first; the open round shows who is still training."""
    is_open = job.state in OPEN_JOB_STATES
    newest = job.round if is_open else job.round - 1
    shown = [r for r in range(newest, newest - ROUNDS_SHOWN, -1) if r >= 0]
    made = {
        (c.round, c.task_id): c
        for c in session.scalars(
            select(Contribution).where(Contribution.job_id == job.id, Contribution.round.in_(shown))
        )
    }
    live = set(session.scalars(select(Lease.task_id).where(Lease.job_id == job.id, Lease.state == "active")))
    names = _names(session, {c.node_id for c in made.values()} | {t.node_id for t in workers if t.node_id})
    val = {r.round: r.val_loss for r in detail.rounds_log}
    convicted = {(v.round, v.task_id): v.node_id for v in detail.verdicts if v.guilty}
    names |= _names(session, set(convicted.values()) - set(names))
    rows = []
    for r in shown:
        open_now = is_open and r == job.round
        cells = []
        for task in workers:
            c = made.get((r, task.id))
            if c is not None:
                cells.append(Cell("contributed", names.get(c.node_id, c.node_id), c.train_loss, c.steps))
            elif (r, task.id) in convicted:
                cells.append(Cell("guilty", names.get(convicted[r, task.id])))
            elif open_now:
                waiting = task.id not in live
                cells.append(Cell("waiting" if waiting else "training", names.get(task.node_id or "")))
            elif task.epoch == 0:  # never leased: it had no node to miss the round on
                cells.append(Cell("unplaced"))
            else:
                cells.append(Cell("missed"))
        rows.append(RoundRow(r, open_now, val.get(r), cells))
    return rows


def job_page(session: Session, blobs: BlobInfo, job: Job, now: float) -> JobPage:
    detail = jobs.detail(session, job, now)
    tasks = _tasks(session, job)
    names = _names(session, {t.node_id for t in tasks if t.node_id})
    workers = [t for t in tasks if t.role == "worker"]
    events = jobs.events(session, job)[-EVENTS_SHOWN:][::-1]
    return JobPage(
        job=detail,
        tasks=[
            TaskRow(t.role, t.index, t.state, names.get(t.node_id or ""), t.node_id, t.epoch, t.placement)
            for t in tasks
        ],
        workers=len(workers),
        rounds=_rounds(session, job, workers, detail),
        traffic=job_traffic(session, blobs, job.id),
        events=events,
    )


def live(session: Session, job: Job, now: float) -> dict:
    """What the job page's script redraws every few seconds: the loss curve and the headline."""
    detail = jobs.detail(session, job, now)
    return {
        "state": detail.state,
        "round": detail.round,
        "rounds": detail.rounds,
        "finished": detail.state not in OPEN_JOB_STATES,
        "points": [
            {"round": r.round, "val_loss": r.val_loss, "train_loss": r.train_loss} for r in detail.rounds_log
        ],
    }
