"""What crossed the wire for a job, from the rows of the round protocol and the sizes of their blobs.

Counted per job (every blob once each way it travels):

- each contribution's pseudo-gradient: uploaded by its worker, downloaded by the aggregator (x 2);
- each published round's blobs (aggregated update, full state when there is one): uploaded once;
- each contribution to round ``r > 0`` began by downloading round ``r``'s aggregated update;
- each worker lease began with one download of the round-0 full state (a join).

DDP for the same work: 2 x params x 4 bytes per worker per inner step, summed over the steps the
contributions report; params is counted from the round-0 full state (fp32 safetensors).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Contribution, Lease, Round, Task
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.stats import Traffic, ddp_bytes


def _round_blobs(session: Session, job_id: str) -> dict[int, tuple[str | None, str | None]]:
    """Round -> (aggregated update, full state) digests: the one place that reads round blob columns."""
    rows = session.execute(select(Round.round, Round.update, Round.checkpoint).where(Round.job_id == job_id))
    return {r: (update, checkpoint) for r, update, checkpoint in rows}


def _worker_leases(session: Session, job_id: str) -> int:
    return session.scalar(
        select(func.count(Lease.id))
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.job_id == job_id, Task.role == "worker")
    )


def job_traffic(session: Session, blobs: BlobInfo, job_id: str) -> Traffic:
    rounds = _round_blobs(session, job_id)
    contributions = session.execute(
        select(Contribution.round, Contribution.delta, Contribution.steps).where(
            Contribution.job_id == job_id
        )
    ).all()
    published = sum(blobs.size(update) + blobs.size(state) for update, state in rounds.values())
    pseudo_gradients = sum(2 * blobs.size(delta) for _, delta, _ in contributions)
    updates_down = sum(blobs.size(rounds.get(r, (None, None))[0]) for r, _, _ in contributions if r > 0)
    initial_state = rounds.get(0, (None, None))[1]
    joins = _worker_leases(session, job_id) * blobs.size(initial_state)
    params = blobs.params(initial_state) or None
    steps = sum(s for _, _, s in contributions)
    return Traffic(
        exchanged=published + pseudo_gradients + updates_down + joins,
        ddp=ddp_bytes(params, steps) if params else None,
        params=params,
    )


def network_bytes(session: Session, blobs: BlobInfo, job_ids: list[str]) -> int:
    return sum(job_traffic(session, blobs, job_id).exchanged for job_id in job_ids)
