"""Matching: which offers qualify for a job, and which of them get its workers and its aggregator.

Workers are ranked by expected cost per useful TFLOP, ``price / (tflops x reliability)``: a
cheap slow or flaky node is not a bargain. Community nodes are placed first; core nodes fill
in only when too few community nodes qualify, because core capacity is scarce and also hosts
aggregators, referees and audits. A job may ask for a trusted backbone (``min_core_workers``:
that many workers go to core nodes first) and may forbid the fallback (``core_fallback``:
its other workers then wait for community nodes). A worker on a core node, whatever the
reason, is metered at that node's own price: that is "the core price". The aggregator runs
only on a core node (it holds the global model, so it must be trusted); it needs little
compute, so only the price cap and the region apply to it, and the cheapest wins. A GPU node must hold
the job's VRAM: ``resources.min_vram_gb``, or unset, the market's estimate (``memory.py``). No task of
any kind goes to a node whose offered time has run out. Every choice carries a reason a person
can read.

Pure functions over frozen values: the coordinator and the simulator call the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuflex.errors import BadRequest
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec

NodeKind = Literal["core", "community"]


@dataclass(frozen=True, slots=True)  # slots: a simulation holds hundreds of thousands of offers
class NodeOffer:
    node_id: str
    name: str
    kind: NodeKind
    price_per_hour: float  # credits per hour
    tflops: float  # benchmarked
    vram_gb: float
    gpus: tuple[str, ...]  # empty: CPU only
    region: str
    reliability: float = 1.0  # 0..1, from reputation
    hours_left: float | None = None  # on offer for this much longer; None: open-ended
    kernels: tuple[str, ...] = ()  # bitsandbytes' kernels its device runs: nf4, int8, adamw8bit


@dataclass(frozen=True)
class Requirements:
    workers: int
    min_vram_gb: float
    min_tflops: float
    accelerators: tuple[str, ...]  # any-of, case-insensitive substrings of GPU names; empty: any
    region: str | None
    max_price_per_hour: float
    min_core_workers: int = 0  # of all the job's workers, at least this many on core nodes
    core_fallback: bool = True  # workers beyond that quota may use core nodes when community is short
    min_workers: int | None = None  # the job starts once this many can be placed together; None: all
    gpu_vram_gb: float = 0.0  # the market's estimate (``memory``), asked of GPU nodes only; 0: none
    devices: int = 1  # GPUs a worker spans on its node (``local_devices``), each holding ``gpu_vram_gb``
    kernels: tuple[str, ...] = ()  # what a quantized base or 8-bit optimizer states need (``memory.kernels``)

    def vram_needed(self, gpu: bool) -> float:
        """GB of VRAM a node needs: ``min_vram_gb``, and on a GPU node (one with VRAM) the estimate too."""
        return max(self.min_vram_gb, self.gpu_vram_gb) if gpu else self.min_vram_gb

    @property
    def start_workers(self) -> int:
        """How many workers must be placed together before the job starts (``resources.min_workers``)."""
        return self.workers if self.min_workers is None else self.min_workers

    @classmethod
    def from_spec(cls, spec: JobSpec | DeploymentSpec) -> Requirements:
        """A job's workers' requirements, or a deployment's replicas' (placed as workers with no aggregator
        and no core quota; it starts once one replica is placed)."""
        # they size models with pricing, which imports us
        from gpuflex.market.memory import kernels, serve_vram_estimate_gb, vram_estimate_gb

        r = spec.resources
        if isinstance(spec, DeploymentSpec):
            size = spec.model.size
            estimate = None
            if r.min_vram_gb is None and size is not None:
                estimate = serve_vram_estimate_gb(size, spec.context, spec.max_batch, spec.dtype)
            workers, min_workers, core_workers, core_fallback = spec.replicas, 1, 0, True
            devices, needs = 1, ()
        else:
            estimate = vram_estimate_gb(spec.training) if r.min_vram_gb is None else None
            workers, min_workers = spec.resources.workers, spec.resources.min_workers
            core_workers, core_fallback = spec.resources.min_core_workers, spec.resources.core_fallback
            devices, needs = spec.training.local_devices, kernels(spec.training)
        return cls(
            workers=workers,
            min_vram_gb=r.min_vram_gb or 0.0,
            gpu_vram_gb=estimate or 0.0,
            min_tflops=r.min_tflops,
            accelerators=tuple(a.strip() for a in r.accelerators if a.strip()),
            region=r.region,
            max_price_per_hour=spec.max_price_per_hour,
            min_core_workers=core_workers,
            core_fallback=core_fallback,
            min_workers=min_workers,
            devices=devices,
            kernels=needs,
        )


@dataclass(frozen=True)
class Choice:
    node_id: str
    reason: str


@dataclass(frozen=True)
class WorkerPlacement:
    """Nodes for a job's unplaced workers, best first, and why the job's own core rules leave some
    of them waiting (None when they do not: the market may simply be short of eligible nodes)."""

    choices: tuple[Choice, ...]
    wait_reason: str | None = None


def _num(x: float, decimals: int) -> str:
    """At least ``decimals`` decimals, more when needed so that unequal numbers never print equal."""
    for d in range(decimals, 7):
        text = f"{x:.{d}f}"
        if float(text) == x:
            return text
    return f"{x:.6f}"


def _price(offer: NodeOffer, req: Requirements) -> str | None:
    if not offer.price_per_hour <= req.max_price_per_hour:  # written so that NaN fails too
        return f"price {_num(offer.price_per_hour, 2)}/h > max {_num(req.max_price_per_hour, 2)}/h"
    return None


def _vram(offer: NodeOffer, req: Requirements) -> str | None:
    needed = req.vram_needed(offer.vram_gb > 0)
    if not offer.vram_gb >= needed:
        estimated = " (the job's estimated need)" if needed > req.min_vram_gb else ""
        return f"vram {_num(offer.vram_gb, 0)} GB < {_num(needed, 0)} GB{estimated}"
    return None


def _devices(offer: NodeOffer, req: Requirements) -> str | None:
    """A GPU node must have a GPU for each of a worker's local devices (a CPU node runs them as ranks)."""
    if req.devices > 1 and offer.vram_gb > 0 and len(offer.gpus) < req.devices:
        return (
            f"{len(offer.gpus)} GPU{'s' * (len(offer.gpus) != 1)} < {req.devices} (the job's local_devices)"
        )
    return None


def _kernels(offer: NodeOffer, req: Requirements) -> str | None:
    missing = [k for k in req.kernels if k not in offer.kernels]
    if missing:
        return f"runs no {', '.join(missing)} kernels (bitsandbytes on its device)"
    return None


def _tflops(offer: NodeOffer, req: Requirements) -> str | None:
    if not offer.tflops >= req.min_tflops:
        return f"tflops {_num(offer.tflops, 1)} < {_num(req.min_tflops, 1)}"
    return None


def _accelerator(offer: NodeOffer, req: Requirements) -> str | None:
    if not req.accelerators:
        return None
    wanted = [a.casefold() for a in req.accelerators]
    if any(w in gpu.casefold() for w in wanted for gpu in offer.gpus):
        return None
    return f"no GPU among [{', '.join(req.accelerators)}]"


def _region(offer: NodeOffer, req: Requirements) -> str | None:
    if req.region is not None and offer.region.casefold() != req.region.casefold():
        return f"region {offer.region} != {req.region}"
    return None


def _available(offer: NodeOffer, req: Requirements) -> str | None:
    if offer.hours_left is not None and not offer.hours_left > 0:
        return "availability ran out (the provider offered it for a limited time)"
    return None


Check = Callable[[NodeOffer, Requirements], str | None]
WORKER_CHECKS: tuple[Check, ...] = (
    _available,
    _price,
    _vram,
    _devices,
    _kernels,
    _tflops,
    _accelerator,
    _region,
)
AGGREGATOR_CHECKS: tuple[Check, ...] = (_available, _price, _region)
# what nodes that fail a check are called when they are too many to name (``market.waiting``)
CHECK_KINDS: dict[Check, str] = {
    _available: "offered hours ran out",
    _price: "price above the cap",
    _vram: "too little VRAM",
    _devices: "too few GPUs",
    _kernels: "no bitsandbytes kernels the job needs",
    _tflops: "too few TFLOPS",
    _accelerator: "no GPU asked for",
    _region: "in another region",
}


def unmet(offer: NodeOffer, req: Requirements) -> list[str]:
    """Why ``offer`` cannot host a worker of this job; empty when it qualifies."""
    return [reason for check in WORKER_CHECKS if (reason := check(offer, req))]


def qualifies(offer: NodeOffer, req: Requirements) -> bool:
    """Whether ``offer`` may host a worker of this job: ``unmet`` is empty (stops at the first reason)."""
    return _passes(offer, req, WORKER_CHECKS)


def can_aggregate(offer: NodeOffer, req: Requirements) -> bool:
    """Whether ``offer`` may host this job's aggregator: a core node within the price cap and region."""
    return offer.kind == "core" and _passes(offer, req, AGGREGATOR_CHECKS)


def _passes(offer: NodeOffer, req: Requirements, checks: tuple[Check, ...]) -> bool:
    """No check finds a reason against ``offer``. A loop, twice as fast as ``all()`` over a generator:
    placement asks it of every offer."""
    for check in checks:  # noqa: SIM110
        if check(offer, req):
            return False
    return True


def cost_per_useful_tflop(offer: NodeOffer) -> float:
    """Credits per hour per useful TFLOPS; infinite when the node does no useful work."""
    useful = offer.tflops * offer.reliability
    return offer.price_per_hour / useful if useful > 0 else math.inf


def worker_rank(offer: NodeOffer) -> tuple[float, float, str]:
    """The order workers are placed in: cost per useful TFLOP, then price, then node id. An index kept
    in this order (the simulator's) hands ``place_workers`` the same best candidates it would find."""
    return (cost_per_useful_tflop(offer), offer.price_per_hour, offer.node_id)


def aggregator_rank(offer: NodeOffer) -> tuple[float, str]:
    """The order aggregators are placed in: price, then node id."""
    return (offer.price_per_hour, offer.node_id)


def _eligible(
    offers: Iterable[NodeOffer],
    exclude: set[str],
    ok: Callable[[NodeOffer], bool],
    key: Callable[[NodeOffer], tuple],
) -> list[NodeOffer]:
    """Qualifying offers sorted by ``key``, one per node (its best offer by ``key``)."""
    best: dict[str, NodeOffer] = {}
    for o in offers:
        if o.node_id in exclude or not ok(o):
            continue
        if o.node_id not in best or key(o) < key(best[o.node_id]):
            best[o.node_id] = o
    return sorted(best.values(), key=key)


def place_workers(
    req: Requirements, offers: Iterable[NodeOffer], *, count: int, exclude: set[str], core_already: int = 0
) -> WorkerPlacement:
    """Up to ``count`` distinct nodes: core nodes the job's core quota still needs, then community
    nodes by rank, then core nodes as fallback when the job allows it.

    Placement is incremental (a lost worker's replacement is placed alone), so ``core_already``
    says how many of the job's workers already run on, or are placed on, core nodes. The slots the
    quota still needs never go to community nodes: short of core nodes, those workers wait rather
    than the job silently running without its backbone.
    """
    if count < 0:
        raise BadRequest(f"worker count must be >= 0, got {count}")
    eligible = _eligible(offers, exclude, lambda o: qualifies(o, req), worker_rank)
    community = [o for o in eligible if o.kind == "community"]
    core = [o for o in eligible if o.kind == "core"]
    return Ranked(community, len(community), core, len(core)).placement(req, count, core_already)


@dataclass(frozen=True)
class Ranked:
    """The eligible offers of each kind best first (at least the first ``count`` a placement needs, or
    all of them), and how many of each kind are eligible in all: what ``place_workers`` decides from,
    however they were found (a scan here, ``market.index.OfferIndex`` at scale)."""

    community: Sequence[NodeOffer]
    community_count: int
    core: Sequence[NodeOffer]
    core_count: int

    def placement(self, req: Requirements, count: int, core_already: int) -> WorkerPlacement:
        owed = min(max(req.min_core_workers - core_already, 0), count)  # quota slots this call must fill
        ranked_core = [
            (o, _worker_reason(o, i, self.core_count, "core")) for i, o in enumerate(self.core[:count])
        ]
        quota = f"core node: the job asks for at least {_core_workers(req.min_core_workers)}; "
        choices = [Choice(o.node_id, quota + why) for o, why in ranked_core[:owed]]
        others = [
            Choice(o.node_id, _worker_reason(o, i, self.community_count, "community"))
            for i, o in enumerate(self.community[:count])
        ]
        spare_core = ranked_core[owed:]
        if req.core_fallback:
            fallback = f"; core node because only {_nodes(self.community_count, 'eligible community')}"
            others += [Choice(o.node_id, why + fallback) for o, why in spare_core]
        # Told as the state after this placement, so the next pass, finding the same, says the same.
        wait_reason = None
        if self.core_count < owed:
            wait_reason = (
                f"the job asks for at least {_core_workers(req.min_core_workers)} "
                f"({core_already + self.core_count} so far) and no eligible core node is free"
            )
        elif not req.core_fallback and spare_core and self.community_count < count - owed:
            wait_reason = "no eligible community node is free and the job forbids core fallback"
        return WorkerPlacement(tuple(choices + others[: count - owed]), wait_reason)


def _core_workers(n: int) -> str:
    return f"{n} core worker{'' if n == 1 else 's'}"


def _worker_reason(offer: NodeOffer, index: int, of: int, kind: str) -> str:
    useful = offer.tflops * offer.reliability
    return (
        f"rank {index + 1} of {_nodes(of, f'eligible {kind}')} by cost per useful TFLOP "
        f"({offer.price_per_hour:.3f} credits/h ÷ {useful:.3g} TFLOPS = {cost_per_useful_tflop(offer):.3g})"
    )


def _nodes(n: int, what: str) -> str:
    return f"{n} {what} node{'' if n == 1 else 's'}"


def place_aggregator(req: Requirements, offers: Iterable[NodeOffer], *, exclude: set[str]) -> Choice | None:
    """The cheapest eligible core node (ties: node_id), or None when no core node qualifies.

    Only availability, the price cap and the region apply: aggregation needs little compute.
    """

    eligible = _eligible(offers, exclude, lambda o: can_aggregate(o, req), aggregator_rank)
    if not eligible:
        return None
    best = eligible[0]
    return Choice(
        best.node_id,
        f"cheapest of {_nodes(len(eligible), 'eligible core')} at {best.price_per_hour:.3f} credits/h "
        "(aggregator runs only on core nodes)",
    )
