"""The network as the overview and providers pages show it: nodes, prices, reliability, totals.

Reliability is the market's reputation score (``services.market.reliabilities``), the same number
that ranks offers and that ``gpuflex offers`` shows.

Read-only queries; earnings of a node are computed only for that node (``own``), never for the list.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, Round
from gpuflex.coordinator.services import ledger, market, registry
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.stats import median
from gpuflex.coordinator.web.traffic import network_bytes
from gpuflex.ledger import accounts
from gpuflex.protocol.money import to_credits


@dataclass(frozen=True)
class Overview:
    online: dict[str, int]  # kind -> nodes online
    nodes: int
    gpus: int
    tflops: float
    running_jobs: int
    queued_jobs: int
    finished_jobs: int
    rounds: int
    price_index: float | None  # median asking price of online nodes, credits/hour
    bytes_exchanged: int


@dataclass(frozen=True)
class ProviderRow:
    node_id: str
    name: str
    kind: str
    state: str
    device: str
    tflops: float
    bandwidth_gbps: float
    price_per_hour: float
    reliability: float  # the reputation score, 0..1
    leases: int
    busy: bool
    last_seen: float
    earnings: float | None  # only for the viewer's own node


def overview(session: Session, blobs: BlobInfo) -> Overview:
    online = registry.online(session)
    jobs = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    job_ids = list(session.scalars(select(Job.id).where(Job.round >= 0)))
    return Overview(
        online=dict(Counter(n.kind for n in online)),
        nodes=len(online),
        gpus=sum(len(n.hardware.get("gpus", [])) for n in online),
        tflops=sum(n.tflops for n in online),
        running_jobs=jobs.get("starting", 0) + jobs.get("running", 0),
        queued_jobs=jobs.get("pending", 0) + jobs.get("scheduled", 0),
        finished_jobs=sum(n for state, n in jobs.items() if state not in market.OPEN_JOB_STATES),
        rounds=session.scalar(select(func.count()).select_from(Round)) or 0,
        price_index=median(to_credits(n.price_micro) for n in online),
        bytes_exchanged=network_bytes(session, blobs, job_ids),
    )


def providers(
    session: Session, now: float, heartbeat_interval_s: float, own: str | None = None
) -> list[ProviderRow]:
    """Every node, online first; ``own`` (the signed-in provider's node id) also sees its earnings."""
    nodes = registry.all_nodes(session)
    ends = market.lease_ends(session)
    scores = market.reliabilities(nodes, ends, now, heartbeat_interval_s)
    rows = []
    for node in nodes:
        gpus = [g["name"] for g in node.hardware.get("gpus", [])]
        mine = node.id == own
        rows.append(
            ProviderRow(
                node_id=node.id,
                name=node.name,
                kind=node.kind,
                state=node.state,
                device=", ".join(gpus) or f"CPU · {node.hardware.get('cpu_cores', '?')} cores",
                tflops=node.tflops,
                bandwidth_gbps=float(node.benchmark.get("mem_bandwidth_gbps", 0.0)),
                price_per_hour=to_credits(node.price_micro),
                reliability=scores[node.id],
                leases=sum(ends[node.id].values()),
                busy=ends[node.id]["active"] > 0,
                last_seen=node.last_heartbeat_at,
                earnings=to_credits(ledger.balance(session, accounts.provider(node.id))) if mine else None,
            )
        )
    return sorted(rows, key=lambda r: (r.state != "online", r.kind != "core", r.price_per_hour, r.name))
