"""What completed jobs took, kept for the quotes' calibration (``market.calibration``).

A job's rounds are read from their publish times: round 0 is the starting state, each later one a
trained round. The steady round is the median interval between trained rounds (the first is slowed by
workers still loading, so it counts only when it is the only one). The model's prediction is taken on
the slowest node that held a worker lease of the job, as the job's rounds waited for it.
"""

from __future__ import annotations

import itertools
import statistics

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, JobTiming, Lease, Node, Round, Task
from gpuflex.coordinator.services import specs
from gpuflex.market import calibration
from gpuflex.market.quotes import predicted_round_s
from gpuflex.protocol.spec import JobSpec


def record(session: Session, job: Job, now: float) -> None:
    """Keep what a completed training job took; nothing for a deployment, or a job that trained no
    round or ran no worker."""
    spec = specs.load(job)
    if not isinstance(spec, JobSpec):
        return
    rounds = select(Round.published_at).where(Round.job_id == job.id).order_by(Round.round)
    times = list(session.scalars(rounds))
    slowest = session.scalar(
        select(func.min(Node.tflops))
        .join(Lease, Lease.node_id == Node.id)
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.job_id == job.id, Task.role == "worker")
    )
    if len(times) < 2 or slowest is None:
        return
    intervals = [b - a for a, b in itertools.pairwise(times)]
    training = spec.training
    session.add(
        JobTiming(
            job_id=job.id,
            finished_at=now,
            wall_s=now - job.created_at,
            rounds=len(intervals),
            steady_round_s=statistics.median(intervals[1:] or intervals),
            predicted_round_s=predicted_round_s(training, slowest),
            time_budgeted=training.round_seconds is not None,
        )
    )


def recent(session: Session) -> list[calibration.JobTiming]:
    """The newest ``calibration.HISTORY`` completed jobs' timings, newest first."""
    rows = session.scalars(
        select(JobTiming).order_by(JobTiming.finished_at.desc()).limit(calibration.HISTORY)
    )
    return [
        calibration.JobTiming(r.wall_s, r.rounds, r.steady_round_s, r.predicted_round_s, r.time_budgeted)
        for r in rows
    ]
