"""The network as the overview and providers pages show it: nodes, prices, reliability, totals.

Read-only queries; earnings of a node are computed only for that node (``own``), never for the list.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, Lease, Round
from gpuflex.coordinator.services import ledger, registry
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.stats import median, reliability
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
    reliability: float | None
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
        running_jobs=jobs.get("running", 0),
        queued_jobs=jobs.get("pending", 0) + jobs.get("scheduled", 0),
        finished_jobs=sum(jobs.get(s, 0) for s in ("completed", "failed", "cancelled")),
        rounds=session.scalar(select(func.count()).select_from(Round)) or 0,
        price_index=median(to_credits(n.price_micro) for n in online),
        bytes_exchanged=network_bytes(session, blobs, job_ids),
    )


def _lease_ends(session: Session) -> dict[str, Counter]:
    ends: dict[str, Counter] = defaultdict(Counter)
    rows = session.execute(
        select(Lease.node_id, Lease.state, func.count()).group_by(Lease.node_id, Lease.state)
    )
    for node_id, state, count in rows:
        ends[node_id][state] += count
    return ends


def providers(session: Session, own: str | None = None) -> list[ProviderRow]:
    """Every node, online first; ``own`` (the signed-in provider's node id) also sees its earnings."""
    ends = _lease_ends(session)
    rows = []
    for node in registry.all_nodes(session):
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
                reliability=reliability(ends[node.id]),
                leases=sum(ends[node.id].values()),
                busy=ends[node.id]["active"] > 0,
                last_seen=node.last_heartbeat_at,
                earnings=to_credits(ledger.balance(session, accounts.provider(node.id))) if mine else None,
            )
        )
    return sorted(rows, key=lambda r: (r.state != "online", r.kind != "core", r.price_per_hour, r.name))
