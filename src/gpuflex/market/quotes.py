"""Quotes: what a job would cost and take if submitted now, on which nodes, or why it cannot be placed.

A quote places the job as the market would now (``placement.place_job``: its aggregator and at least
``min_workers`` workers together, among the online offers less the nodes ``held``), names the nodes
it assumes, and estimates from their benchmarked TFLOPS what the job costs and how long it takes:
``rounds x (compute + exchange)`` (``pricing.round_seconds``), corrected by what the network's
completed jobs took (``calibration``; see ``quote`` for the range's rule). It
also says in how many rounds shirking would pay a worker in expectation (``pricing.shirking_pays_rounds``).
What cannot be placed is told node by node (``market.waiting``): which node could not take which
task, and why — busy, barred, short of stake, or the first requirement it fails.

Pure, like the rest of ``market``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpuflex.errors import BadRequest
from gpuflex.market.calibration import Calibration, JobTiming
from gpuflex.market.index import OfferIndex
from gpuflex.market.matching import NodeOffer, Requirements, unmet
from gpuflex.market.memory import GIB, vram_estimate_gb, ways_to_fit, worker_memory
from gpuflex.market.placement import JobPlacement, place_job
from gpuflex.market.pricing import (
    EFFICIENCY,
    LINK_BYTES_PER_S,
    REPLACEMENTS,
    ROUND_OVERHEAD_S,
    parameter_count,
    round_seconds,
    shirking_pays_rounds,
    slash_to_deter,
    step_seconds,
    tokens_per_step,
    trained_count,
)
from gpuflex.market.waiting import Held, why_waiting
from gpuflex.protocol.spec import JobSpec, TrainingSpec


@dataclass(frozen=True)
class QuoteNode:
    node_id: str
    name: str
    kind: str
    role: str  # aggregator | worker
    ask: float  # the node's own price, credits per hour
    paid: float  # what it would be paid per hour: its ask, or the auction's clearing price
    tflops: float
    seconds_per_step: float | None  # at the expected efficiency; None for the aggregator


@dataclass(frozen=True)
class Quote:
    """What a job would cost and take if submitted now (seconds, credits), or why it cannot be placed."""

    pricing: str
    placeable: bool
    problems: tuple[str, ...] = ()
    nodes: tuple[QuoteNode, ...] = ()
    clearing_price: float | None = None
    duration_s: float | None = None
    duration_low_s: float | None = None
    duration_high_s: float | None = None
    cost: float | None = None
    cost_low: float | None = None
    cost_high: float | None = None
    budget: float = 0.0
    budget_lasts_s: float | None = None  # set when the budget runs out before the expected duration
    shirking_pays_rounds: int | None = None  # see ``shirking_pays_rounds``
    slash_to_deter: float | None = None  # the slash that deters shirking from round 1 (None: no audits)
    assumptions: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()  # placeable, but not every worker at once: why the others would wait
    vram_estimate_gb: float | None = None  # ``memory.vram_estimate_gb``: asked of GPU nodes when unset
    host_estimate_gb: float | None = None  # ``memory.worker_memory``'s host part
    too_big: str | None = None  # the estimate exceeds every online GPU node: by how much, what would fit


def quote(
    spec: JobSpec,
    offers: Sequence[NodeOffer],
    held: Mapping[str, Held] | None = None,
    timings: Sequence[JobTiming] = (),
) -> Quote:
    """Estimate a job's duration and cost on ``offers`` (the online nodes; those in ``held`` take no
    task, for the reason given), placing it as the market would: the aggregator first, then the
    workers (by rank, or by auction), at least ``min_workers`` of them or none; calibrated on
    ``timings``, what the network's newest completed jobs took (``calibration``).

    Per round: compute, then the exchange. Compute is ``inner_steps`` steps on the slowest chosen
    worker (rounds wait for the quorum), a step being 6 x parameters x tokens FLOPs at the node's
    TFLOPS x ``EFFICIENCY`` (÷ ``local_devices``); a time-budgeted job (``round_seconds``) stops a
    round at that budget, so compute is the smaller of the two. The exchange is one upload and one
    download of the compressed update over ``LINK_BYTES_PER_S`` plus ``ROUND_OVERHEAD_S``; with
    ``overlap`` it hides behind compute. The duration is that round's time corrected by the calibration
    (its speed factor), times the rounds, plus the calibration's fixed seconds to start and finish. Cost
    = Σ paid price x duration, aggregator included, capped by the budget.

    The range: low = the calibration's low end; high = its high end with ``REPLACEMENTS`` worker(s) lost
    and replaced by the slowest eligible node left over (in fixed pricing, paid as the priciest one left
    over), each loss costing one extra round.
    """
    if parameter_count(spec.training) is None and spec.training.round_seconds is None:
        raise BadRequest(
            "a user recipe's model size is unknown, so its step time is too: "
            "set training.round_seconds to quote a time-budgeted job"
        )
    req, held = Requirements.from_spec(spec), dict(held or {})
    memory = _memory(spec, req, offers)
    index = OfferIndex(offers)
    placement = place_job(
        req,
        spec.pricing,
        offers,
        aggregator=True,
        workers=req.workers,
        busy=set(held),
        index=index,
        gang=req.start_workers,
    )
    chosen = _chosen(placement)
    agg_waits, workers_wait = why_waiting(
        index, req, placement, aggregator=True, workers=req.workers, held={**held, **chosen}
    )
    if agg_waits or placement.short:
        problems = tuple(dict.fromkeys(str(w) for w in (agg_waits, workers_wait) if w))
        return Quote(spec.pricing, False, problems=problems, budget=spec.budget, **memory)
    by_id = {o.node_id: o for o in offers}
    workers = [by_id[c.node_id] for c in placement.workers.choices]
    spares = _spares(req, offers, set(held) | set(chosen), placement.clearing_price)
    time_budgeted = spec.training.round_seconds is not None
    calibration = Calibration.of(timings, time_budgeted=time_budgeted)
    agg = by_id[placement.aggregator.node_id]
    estimate = _estimate(spec, agg, workers, spares, placement.clearing_price, calibration)
    estimate = replace(estimate, **memory)
    if workers_wait is None:
        return estimate
    late = req.workers - len(workers)
    told = f"{late} of the {req.workers} workers would wait, and join when a node frees: {workers_wait}"
    return replace(estimate, waiting=(told,))


def _chosen(placement: JobPlacement) -> dict[str, Held]:
    """The nodes a placement took, held for this job (what it could not place is told around them)."""
    worker = Held("this job's", "would run one of this job's workers")
    chosen = {c.node_id: worker for c in placement.workers.choices}
    if placement.aggregator is not None:
        chosen[placement.aggregator.node_id] = Held("this job's", "would host this job's aggregator")
    return chosen


def _spares(
    req: Requirements, offers: Sequence[NodeOffer], taken: set[str], clearing: float | None
) -> list[NodeOffer]:
    """Eligible nodes neither held nor taken by the job: where a replacement could land (asking at most
    the clearing price, in an auction)."""
    cap = req.max_price_per_hour if clearing is None else clearing
    return [o for o in offers if o.node_id not in taken and not unmet(o, req) and o.price_per_hour <= cap]


def _estimate(
    spec: JobSpec,
    agg: NodeOffer,
    workers: list[NodeOffer],
    spares: list[NodeOffer],
    clearing: float | None,
    calibration: Calibration,
) -> Quote:
    training = spec.training
    params = parameter_count(training)

    def step_s(o: NodeOffer, efficiency: float) -> float | None:
        return step_seconds(training, o.tflops, efficiency)

    def duration(end: int, slowest: NodeOffer, extra_rounds: int) -> float:
        predicted = predicted_round_s(training, slowest.tflops)
        return calibration.duration_s(end, training.rounds + extra_rounds, predicted)

    def paid(o: NodeOffer) -> float:
        return o.price_per_hour if clearing is None else clearing

    rate = agg.price_per_hour + sum(paid(w) for w in workers)  # credits per hour
    pricier = max((paid(o) for o in spares), default=0.0) - min(paid(w) for w in workers)
    rate_high = rate + max(pricier, 0.0)
    slowest = min(workers, key=lambda o: o.tflops)
    expected = duration(1, slowest, 0)
    round_pay = max(paid(w) for w in workers) * expected / training.rounds / 3600  # the best-paid worker's
    low = duration(0, slowest, 0)
    high = duration(2, min([*workers, *spares], key=lambda o: o.tflops), REPLACEMENTS)
    budget_lasts = spec.budget / rate * 3600 if rate > 0 else math.inf
    agg_node = QuoteNode(
        agg.node_id,
        agg.name,
        agg.kind,
        "aggregator",
        agg.price_per_hour,
        paid=agg.price_per_hour,
        tflops=agg.tflops,
        seconds_per_step=None,
    )
    worker_nodes = [
        QuoteNode(
            w.node_id, w.name, w.kind, "worker", w.price_per_hour, paid(w), w.tflops, step_s(w, EFFICIENCY)
        )
        for w in workers
    ]
    return Quote(
        pricing=spec.pricing,
        placeable=True,
        nodes=(agg_node, *worker_nodes),
        clearing_price=clearing,
        duration_s=expected,
        duration_low_s=low,
        duration_high_s=high,
        cost=min(spec.budget, rate * expected / 3600),
        cost_low=min(spec.budget, rate * low / 3600),
        cost_high=min(spec.budget, rate_high * high / 3600),
        budget=spec.budget,
        budget_lasts_s=budget_lasts if budget_lasts < expected else None,
        shirking_pays_rounds=shirking_pays_rounds(training, round_pay),
        slash_to_deter=slash_to_deter(training.verification, round_pay),
        assumptions=_assumptions(params, training, calibration),
    )


def _memory(spec: JobSpec, req: Requirements, offers: Sequence[NodeOffer]) -> dict:
    """A quote's memory figures: the estimate per device and in host memory, and, when no online GPU node
    holds a worker, one line saying so and what would fit on the largest of them."""
    training = spec.training
    worker = worker_memory(training)
    figures: dict = {
        "vram_estimate_gb": vram_estimate_gb(training),
        "host_estimate_gb": None if worker is None else math.ceil(worker.host / GIB * 10) / 10,
    }
    need = req.gpu_vram_gb
    gpus = [o for o in offers if o.vram_gb > 0]
    if not need or not gpus or any(o.vram_gb >= need and len(o.gpus) >= req.devices for o in gpus):
        return figures
    largest = max(gpus, key=lambda o: (o.vram_gb, len(o.gpus)))
    count = len(largest.gpus) or 1
    on = f"each of its {req.devices} GPUs" if req.devices > 1 else "its GPU"
    told = (
        f"a worker needs ≈ {need:g} GB of VRAM on {on} by the market's estimate; the largest online GPU node "
        f"has {count} × {largest.vram_gb:g} GB"
    )
    ways = ways_to_fit(training, largest.vram_gb, count)
    told += (
        f": it would fit with {'; or '.join(ways)}" if ways else ": nothing in the spec alone makes it fit"
    )
    return {**figures, "too_big": told + " (or set resources.min_vram_gb to choose the nodes yourself)"}


def predicted_round_s(training: TrainingSpec, tflops: float) -> float:
    """The pricing model's seconds for one round of ``training`` on a worker of ``tflops``, before
    calibration: what a completed job's measured rounds are compared with."""
    return round_seconds(training, step_seconds(training, tflops, EFFICIENCY), trained_count(training))


def _assumptions(params: int | None, training: TrainingSpec, calibration: Calibration) -> tuple[str, ...]:
    size = "unknown (user recipe)" if params is None else f"{params:,} parameters"
    return (
        f"model: {size}, {tokens_per_step(training):,} tokens per step, 6 FLOPs per parameter per token",
        f"efficiency {EFFICIENCY:g} of benchmarked TFLOPS",
        f"exchange over {LINK_BYTES_PER_S * 8 / 1e6:g} Mbit/s plus {ROUND_OVERHEAD_S:g} s per round",
        f"slow end: {REPLACEMENTS} worker replaced by the slowest eligible spare, one round lost",
        calibration.describe(),
    )
