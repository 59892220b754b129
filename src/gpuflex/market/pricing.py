"""Pricing: what a job will pay its nodes (fixed asks or a sealed-bid reverse auction), and what its
rounds take (the model behind ``market.quotes``).

**Modes** (``pricing`` in the job spec). ``fixed``: every node is paid its own asking price.
``auction``: a sealed-bid reverse auction for the job's k workers. The job posts its maximum
(``max_price_per_hour``); each eligible provider's ask is its ``price_per_hour``; the k lowest asks
win (ties: cost per useful TFLOP, then node id) and every winner is paid one uniform clearing price,
the (k+1)-th lowest ask, or the job's maximum when only k asks are eligible.

*Why asking your true cost is a dominant strategy* (Vickrey's argument, for sellers of one unit
each, which a node is: it runs one task at a time). A seller's ask decides only *whether* it wins,
never *what* it is paid: the price is set by the best losing ask. Asking above your cost can only
turn a profitable win (price > cost) into a loss of the job; asking below it can only win you the
job at a price below your cost. Either way, nothing is gained by lying.

*What it does not guarantee.* Collusion: sellers who agree to raise their asks together raise the
(k+1)-th ask, and so everyone's pay. Shill asks: a provider that also runs a high-asking node that
it does not mean to win sets the clearing price for its winning nodes (identities are cheap keys, so
the market cannot tell). Nor does it make a replacement truthful: a replacement worker placed after
a loss is paid the job's clearing price, and only nodes asking no more than it qualify.

The auction's pool follows the job's core rules as matching does: community nodes bid; core nodes
bid too only when too few community nodes qualify and the job allows core fallback. A core quota
(``min_core_workers``) does not combine with an auction (the spec refuses it). The aggregator is
never auctioned: it is paid its own core price.

**Time and pay** of a round: ``step_seconds`` from a node's benchmark and the model's size,
``round_seconds`` with the exchange, and in how many rounds shirking would pay a worker in
expectation (``shirking_pays_rounds``); quotes (``market.quotes``) are built on them.

Pure functions over frozen values, like ``matching``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from gpuflex.errors import BadRequest
from gpuflex.market.matching import (
    Choice,
    NodeOffer,
    Requirements,
    WorkerPlacement,
    cost_per_useful_tflop,
    place_workers,
    qualifies,
)
from gpuflex.protocol.spec import TrainingSpec, VerificationSpec

Price = TypeVar("Price", int, float)  # credits per hour, or micro-credits per hour

# -- the model's assumptions, each with where it comes from --------------------------------------
# Achieved training FLOP/s ÷ the node's benchmarked TFLOPS. Measured on the project's 2-core dev
# CPU (torch, one thread, as the local network's tasks run): char-gpt as in examples/char-gpt.yaml
# (254,592 parameters, batch 32 x 64 bytes) took 0.0531 s per AdamW step, 18.8 steps/s, i.e.
# 58.9 GFLOP/s counted as 6 x params x tokens; the agent's benchmark on the same machine gave
# 0.0823 TFLOPS fp32 with one thread (an agent benchmarks with its tasks' thread count; 0.0943 with
# torch's default two). 58.9 / 82.3 = 0.72. A GPU runs so small a model far below its peak, and a
# busy host slows a CPU: what a network's jobs actually take corrects it (``calibration``).
EFFICIENCY = 0.7
# Per round, besides moving bytes: the worker's and the aggregator's polls (0.2 s each) and the
# request round trips. Not measured: an assumption of the order of the poll intervals.
ROUND_OVERHEAD_S = 0.5
# Offers carry no network speed yet: pseudo-gradients are assumed to cross a 100 Mbit/s link.
LINK_BYTES_PER_S = 12.5e6
REPLACEMENTS = 1  # a quote's slow end assumes this many workers are lost and replaced mid-job
VOCAB = 256  # byte-level recipes (gpuflex.train.data.VOCAB_SIZE; market may not import train)
DIGITS_PIXELS, DIGITS_CLASSES = 64, 10  # mlp-digits' input and output widths
_BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}


# -- the auction ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    node_id: str
    price: float  # credits per hour: the node's asking price
    cost_per_useful_tflop: float = 0.0  # tie-breaker between equal asks


@dataclass(frozen=True)
class Clearing:
    """The k winning asks, lowest first, and the uniform price each is paid; or, when fewer than
    k asks are eligible (at most the job's maximum), no winners, no price and why."""

    winners: tuple[Ask, ...]
    price: float | None
    eligible: int  # asks at most the maximum
    short: str | None = None


def ask_rank(ask: Ask) -> tuple[float, float, str]:
    return (ask.price, ask.cost_per_useful_tflop, ask.node_id)


def clear_auction(asks: Iterable[Ask], k: int, max_price: float) -> Clearing:
    """The k lowest asks win; each is paid the (k+1)-th lowest ask, or ``max_price`` if there is none."""
    if k < 1:
        raise BadRequest(f"an auction needs k >= 1 winners, got {k}")
    eligible = sorted((a for a in asks if a.price <= max_price), key=ask_rank)  # NaN asks never qualify
    if len(eligible) < k:
        short = f"the auction needs {k} eligible asks at most {max_price:.3f}/h and has {len(eligible)}"
        return Clearing((), None, len(eligible), short)
    price = eligible[k].price if len(eligible) > k else max_price
    return Clearing(tuple(eligible[:k]), price, len(eligible))


def auction_pool(req: Requirements, offers: Iterable[NodeOffer], exclude: set[str]) -> list[NodeOffer]:
    """The offers that bid for a job's workers: eligible community nodes, and eligible core nodes
    too when community nodes alone cannot fill the job and it allows core fallback."""
    best: dict[str, NodeOffer] = {}
    for o in offers:
        eligible = o.node_id not in exclude and qualifies(o, req)
        if eligible and (o.node_id not in best or o.price_per_hour < best[o.node_id].price_per_hour):
            best[o.node_id] = o
    community = [o for o in best.values() if o.kind == "community"]
    if len(community) < req.workers and req.core_fallback:
        return list(best.values())
    return community


def place_auction(
    req: Requirements, offers: Iterable[NodeOffer], *, count: int, exclude: set[str], least: int | None = None
) -> tuple[WorkerPlacement, float | None]:
    """Auction ``count`` workers, or as many as there are eligible asks if that is at least ``least``
    (a job's ``min_workers``; default ``count``): the winners with their reasons and the clearing price;
    when the auction cannot clear, no choices, no price and why the workers wait."""
    pool = auction_pool(req, offers, exclude)
    asks = [Ask(o.node_id, o.price_per_hour, cost_per_useful_tflop(o)) for o in pool]
    eligible = sum(a.price <= req.max_price_per_hour for a in asks)
    k = count if least is None or eligible >= count else max(eligible, least)
    clearing = clear_auction(asks, k, req.max_price_per_hour)
    if clearing.price is None:
        return WorkerPlacement((), clearing.short), None
    choices = tuple(
        Choice(
            a.node_id,
            f"won the auction at ask {a.price:.3f}, clearing price {clearing.price:.3f} credits/h "
            f"({k} lowest of {clearing.eligible} eligible asks)",
        )
        for a in clearing.winners
    )
    return WorkerPlacement(choices), clearing.price


def place_replacement(
    req: Requirements,
    offers: Iterable[NodeOffer],
    clearing_price: float,
    *,
    count: int,
    exclude: set[str],
    core_already: int = 0,
) -> WorkerPlacement:
    """Workers of an auction job placed after it cleared (a lost node's replacement): the usual
    ranking among nodes asking at most the clearing price, which is what they are paid."""
    capped = replace(req, max_price_per_hour=min(req.max_price_per_hour, clearing_price))
    placement = place_workers(capped, offers, count=count, exclude=exclude, core_already=core_already)
    prefix = f"replacement paid the auction's clearing price {clearing_price:.3f} credits/h; "
    return replace(placement, choices=tuple(replace(c, reason=prefix + c.reason) for c in placement.choices))


# -- sizes of a job's model -----------------------------------------------------------------------


def parameter_count(training: TrainingSpec) -> int | None:
    """Parameters of the recipe's model, from the spec's shape; None for a user recipe (unknown).

    char-gpt and hf-causal-lm gpt2 (tied head, biases, learned positions):
        V·d + T·d + L·(12d² + 13d) + 2d
    hf-causal-lm llama (untied head, no biases, RMSNorm, rotary positions, 4d MLP with a gate):
        2·V·d + L·(16d² + 2d) + d
    mlp-digits (64 pixels, L hidden layers of width d, 10 classes):
        64·d + d + (L−1)·(d² + d) + 10·d + 10
    with V = 256 bytes, d = n_embd, L = n_layer, T = block_size. char-gpt's default shape gives
    254,592, as ``CharGPT.num_params`` counts. A model directory (``model.from``): the CLI's count.
    """
    m = training.model
    if m.size is not None:  # a model directory, counted by the CLI
        return m.size.parameters
    d, n_layer = m.n_embd, m.n_layer
    if training.recipe == "mlp-digits":
        return DIGITS_PIXELS * d + d + (n_layer - 1) * (d * d + d) + DIGITS_CLASSES * d + DIGITS_CLASSES
    if training.recipe == "hf-causal-lm" and m.architecture == "llama":
        return 2 * VOCAB * d + n_layer * (16 * d * d + 2 * d) + d
    if training.recipe in ("char-gpt", "hf-causal-lm"):
        return VOCAB * d + m.block_size * d + n_layer * (12 * d * d + 13 * d) + 2 * d
    return None


def trained_count(training: TrainingSpec) -> int | None:
    """Parameters the job trains, and so exchanges each round: LoRA's adapters, or all of them."""
    size = training.model.size
    return size.trainable if size is not None else parameter_count(training)


def tokens_per_step(training: TrainingSpec) -> int:
    """Samples a step trains on, times their length for the byte-level language models."""
    if training.recipe in ("char-gpt", "hf-causal-lm"):
        return training.batch_size * training.model.block_size
    return training.batch_size


def bytes_per_value(training: TrainingSpec) -> float:
    """Bytes one parameter takes on the wire under the job's compression (top-k: its indices too)."""
    c = training.compression
    if c.method != "topk":
        return _BYTES_PER_VALUE[c.method]
    index_bytes = math.log2(c.block_size) / 8  # bit-packed indices within a chunk
    return c.density * (_BYTES_PER_VALUE[c.values] + index_bytes)


def shirking_pays_rounds(training: TrainingSpec, round_pay: float) -> int:
    """In how many rounds, from its first in the job, a worker paid ``round_pay`` a round gains more than
    it risks, in expectation, by skipping part of its work.

    Skipping a share s of a round saves at most s of the round's pay, and looks honest to every check
    but an audit of a skipped segment (``bench/README.md``: skip-segment): it is caught with probability
    audit_rate·s, and then loses the slash and all its pay held for the job, this round's included (a
    guilty verdict withholds it). Gain and risk both scale with s, so in round r (held pay r·round_pay)
    it pays iff audit_rate·(slash + r·round_pay) < round_pay. Every round, without audits or screens."""
    v = training.verification
    if slash_to_deter(v, round_pay) is None:
        return training.rounds
    if round_pay <= 0:
        return 0
    return min(training.rounds, max(0, math.ceil(1 / v.audit_rate - v.slash / round_pay) - 1))


def slash_to_deter(verification: VerificationSpec, round_pay: float) -> float | None:
    """The least ``verification.slash`` that deters shirking from round 1: audit_rate·(slash + round_pay)
    >= round_pay. None when nothing is audited (no slash deters what is never checked)."""
    if not verification.robust or verification.audit_rate == 0:
        return None
    return max(0.0, round_pay * (1 / verification.audit_rate - 1))


def step_seconds(training: TrainingSpec, tflops: float, efficiency: float = EFFICIENCY) -> float | None:
    """Seconds of one inner step on a node of ``tflops`` benchmarked TFLOPS: 6 x parameters x tokens
    FLOPs at ``efficiency`` of it (÷ ``local_devices``); None when the model's size is unknown."""
    params = parameter_count(training)
    if params is None:
        return None
    flops = 6 * params * tokens_per_step(training) / training.local_devices
    return flops / (max(tflops, 1e-9) * 1e12 * efficiency)


def round_seconds(
    training: TrainingSpec,
    step_s: float | None,
    params: int | None,
    *,
    link_bytes_per_s: float = LINK_BYTES_PER_S,
    overhead_s: float = ROUND_OVERHEAD_S,
) -> float:
    """Seconds of one round: compute on the slowest worker, then (or, with overlap, during) the exchange
    of one compressed update up and one down over ``link_bytes_per_s``, plus ``overhead_s``."""
    compute = training.round_seconds if step_s is None else training.inner_steps * step_s
    if training.round_seconds is not None:
        compute = min(compute, training.round_seconds)
    moved = 0.0 if params is None else 2 * params * bytes_per_value(training) / link_bytes_per_s
    exchange = moved + overhead_s
    return max(compute, exchange) if training.overlap else compute + exchange


def lease_price(role: str, own: Price, clearing: Price | None) -> Price:
    """What a lease is metered at: the node's own price, or its job's auction clearing price for a worker."""
    return clearing if role == "worker" and clearing is not None else own
