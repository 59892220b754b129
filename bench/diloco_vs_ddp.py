"""DiLoCo against DDP over a simulated home link: validation loss, bytes per worker, wall time, utilization.

    python bench/diloco_vs_ddp.py                   # the reported mode: 3 seeds, mean ± std (bench/README.md)
    python bench/diloco_vs_ddp.py --quick           # one seed, 200 steps instead of 1,200, fewer configs
    python bench/diloco_vs_ddp.py --data DIR        # the UTF-8 text files under DIR instead of the stdlib's
    python bench/diloco_vs_ddp.py --configs ddp-muon,diloco-muon-int2 --seeds 1   # a part of a run
    python bench/diloco_vs_ddp.py --sizes           # the gap against model size (0.1M, 0.4M, 1.6M)
    python bench/diloco_vs_ddp.py --sizes 20M,50M   # named sizes (these two are for a GPU)

Every config trains the same char-gpt model on the same data, with the same workers, batch size, lr
schedule and token budget (``steps`` per worker), each worker behind the same simulated link
(100 Mbit/s each way, 50 ms per call), with one of two inner optimizers: AdamW, or Muon for the hidden
weight matrices (``training.inner_optimizer: muon``, MuLoCo). For each optimizer: (a) DDP, a gloo
all-reduce every step (``bench/ddp.py``: ``ddp-adamw``, ``ddp-muon``), then DiLoCo with (b) fp32,
(c) int8, dense 2-bit without and with the exchange overlapped with compute, and (d) the strongest
compression we have, SparseLoCo's chunked top-k 2% with 2-bit values and error feedback
(``diloco-adamw-int2``, ``diloco-muon-topk2%-int2-overlap``, ...). The DiLoCo configs are real jobs of
``gpuflex.train.local``: an aggregator and the workers as processes, every byte metered on the
workers' links as it crosses them (blobs, messages and the checkpoint a worker joins from; the
dataset, which every node holds, excepted).

Every DiLoCo config is measured against the *better* DDP baseline (the lower validation loss), so no
config wins by a weak baseline: that gives ``loss_gap``, ``best_bytes_ratio_vs_ddp`` and ``frontier``.
``per_optimizer`` keeps the same against each optimizer's own DDP.

Then the heterogeneous case, with ``diloco-adamw-int2-overlap``'s settings: time-budgeted rounds with
equal workers, the same with one worker three times slower, and synchronous DiLoCo (fixed H, no
overlap) with that slow worker. ``hetero_slowdown`` is the slow run's wall time to the target loss over
the equal run's; the target is the loss both reach (the worse of their two final losses).

``--quick`` runs one seed of 200 steps and only ``QUICK_CONFIGS``: both DDP baselines, each optimizer's
``int2`` and ``int2-overlap`` and the heterogeneous case: 9 runs, as many as before Muon's configs
(about 7 minutes on 2 cores shared with other work; all 12 configs would take about 5 more).
``--configs`` picks configs by name (``hetero`` is the heterogeneous case), ``--seeds`` the seeds: the
results of a run are merged into its results file when that file was written with the same settings (a
run of the same config and seed replaces the earlier one; ``--fresh`` starts over), and the file is
written after every seed, so a long run can be split and resumed.

It writes ``bench/results/diloco_vs_ddp[-CORPUS][-quick].json`` (every run, with its loss curve; CORPUS
is ``--data``'s directory name when it is not the stdlib) and ``.png`` (loss against bytes per worker,
and against wall time), and prints one JSON object as its last line.

``--sizes`` instead runs ``SIZE_CONFIGS`` (both DDP baselines and each optimizer's fp32 and int2) at
each named size (``SIZES``: the model and its token budget), and measures each DiLoCo config's gap
against its own optimizer's DDP and against the better DDP, beside the M = 4 column of "Scaling Laws for
DiLoCo" (Table 4). It writes ``bench/results/diloco_sizes[-CORPUS][-quick].json`` and ``.png`` (the gap
against parameters, on a log axis) and prints its own JSON line last: the gaps by optimizer,
compression and size, whether each falls with size, and each size's parameters and better DDP (``--quick``:
a third of each size's steps). The sizes' runs meter no link
(``Link()``): they measure loss, and a throttled all-reduce would only make DDP slower. The workers
(``gpuflex.train.worker``) and DDP's ranks train on CUDA when the machine has it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddp import run_ddp

from gpuflex.cli.train import text_extensions
from gpuflex.market.pricing import parameter_count
from gpuflex.protocol.spec import CompressionSpec, ModelSpec, TrainingSpec
from gpuflex.train.corpus import build_corpus
from gpuflex.train.local import LocalResult, WorkerOptions, run_local
from gpuflex.train.throttle import Link

# -- settings ---------------------------------------------------------------------------------------
WORKERS = 4  # replicas, as in the calibration
LINK = Link(bandwidth_bps=100e6, latency_s=0.05)  # a home line: 100 Mbit/s each way, 50 ms a call
MAX_GAP = 0.02  # a config qualifies if its validation loss is within 2% of the better DDP's
SLOWDOWN = 3.0  # the heterogeneous case: one worker this many times slower
POLL_S = 0.2  # how often tasks poll for a round (the runtime's default)
# No audits: this compares the training algorithms' traffic, and DDP has no verification. An audit
# uploads the drawn worker's whole training state (parameters and optimizer moments: 2-5 MB at the
# default model), which at the network's default audit_rate 0.05 was 55-60% of an int2 worker's bytes
# over 24 rounds (2026-11-26); bench/verification.py measures what verification costs.
AUDIT_RATE = 0.0
RESULTS = Path(__file__).parent / "results"
HETERO_NAME = "hetero"  # --configs' name for the heterogeneous case

Optimizer = Literal["adamw", "muon"]
ADAMW_LR = 3e-3  # the spec's default peak lr, for AdamW in DDP and DiLoCo
MUON_LR = 1.2e-2  # Muon's peak lr in DiLoCo (its hidden matrices' and the AdamW rest's): see Config
MUON_DDP_LR = 2.4e-2  # and in DDP, where it did best: the stronger baseline
MUON_H = 50
MUON_OUTER_LR = 1.5
MUON_OUTER_MOMENTUM = 0.0


def _none() -> CompressionSpec:
    return CompressionSpec(method="none")


@dataclass(frozen=True)
class Config:
    """A run's settings: a DDP baseline (``ddp``) or a DiLoCo config.

    AdamW's DiLoCo configs take the outer step with SGD, lr 1.5 and no momentum. Each worker's AdamW
    normalises its steps by its own small batch's noise, and the mean of W such deltas is shorter than
    the progress any one of them made, so an outer lr above 1 gives that back. Measured on the default
    mode's model and budget (fp32, H = 50, one seed, stdlib text): outer lr 1.0 7.4% behind DDP, 1.5
    4.2%, 2.0 diverging; DiLoCo's Nesterov (0.7, momentum 0.9) 8.3%, as 24 rounds are too few for
    momentum to build up; and even H = 10 at lr 1.0 stays 5.9% behind.

    Muon's settings (``MUON_*``), tuned on the stdlib corpus with seed 0 and ``--quick``'s budget (200
    steps per worker; validation loss; ``ddp-adamw`` 2.562 and ``diloco-adamw-int2`` 2.560 there; AdamW's
    DDP at lr 1e-2: 2.616). Muon wants a higher lr than AdamW's 3e-3, in DDP and in DiLoCo alike. DDP:
    lr 3e-3 2.409, 6e-3 2.224, 1.2e-2 1.975, 2.4e-2 1.901, 4.8e-2 1.905; at 600 steps 2.4e-2 1.673 and
    1.2e-2 1.678, so ``ddp-muon`` takes 2.4e-2. DiLoCo int2, outer SGD 1.5, H = 50: inner lr 3e-3 2.473,
    6e-3 2.365, 1.2e-2 2.259, 2.4e-2 2.260 (1.2e-2 taken: as good, and safer over 1,200 steps); at
    1.2e-2, outer lr 1.0 2.271, 2.0 2.344, 2.5 2.519; Nesterov 0.7 / 0.9 2.431 (4 rounds); H = 25 2.192
    (twice the bytes: not taken, H stays AdamW's 50); fp32 2.169, int2 with overlap 2.417 (utilization
    0.979). So Muon keeps AdamW's outer step. Its DiLoCo gap to ``ddp-muon`` is large at this budget and
    shrinks with steps: int2 19% at 200 steps, 9.0% at 600 (1.824 against 1.673).
    """

    name: str
    inner_steps: int  # H; DDP evaluates every this many steps
    compression: CompressionSpec = field(default_factory=_none)
    overlap: bool = False  # compute round r+1 while round r is exchanged (one-round-delayed update)
    outer_lr: float = 1.5
    outer_momentum: float = 0.0
    optimizer: Optimizer = "adamw"  # training.inner_optimizer
    lr: float = ADAMW_LR  # the inner optimizer's peak lr
    ddp: bool = False  # the DDP baseline for ``optimizer``: no outer step, no compression


# SparseLoCo's compression: of each chunk of 256 values the largest 2% (6 values: 8-bit indices, 2-bit
# values, one scale per chunk), with error feedback that keeps everything it has not sent yet.
SPARSE = CompressionSpec(method="topk", density=0.02, values="int2", block_size=256, error_decay=1.0)


def family(optimizer: Optimizer, inner_steps: int, **settings: Any) -> list[Config]:
    """One inner optimizer's DiLoCo configs, ``diloco-<optimizer>-<compression>``."""
    int2 = CompressionSpec(method="int2")
    variants = [
        ("fp32", _none(), False),
        ("int8", CompressionSpec(method="int8"), False),
        ("int2", int2, False),
        ("int2-overlap", int2, True),
        ("topk2%-int2-overlap", SPARSE, True),
    ]
    return [
        Config(
            f"diloco-{optimizer}-{suffix}", inner_steps, compression, overlap, optimizer=optimizer, **settings
        )
        for suffix, compression, overlap in variants
    ]


BASELINES = [
    Config("ddp-adamw", 50, ddp=True),
    Config("ddp-muon", 50, optimizer="muon", lr=MUON_DDP_LR, ddp=True),
]
CONFIGS = [
    *family("adamw", 50),
    *family("muon", MUON_H, lr=MUON_LR, outer_lr=MUON_OUTER_LR, outer_momentum=MUON_OUTER_MOMENTUM),
]
BY_NAME = {c.name: c for c in BASELINES + CONFIGS}
HETERO = BY_NAME["diloco-adamw-int2-overlap"]  # time-budgeted rounds need the overlap to pay off
QUICK_CONFIGS = (
    "ddp-adamw",
    "ddp-muon",
    "diloco-adamw-int2",
    "diloco-adamw-int2-overlap",
    "diloco-muon-int2",
    "diloco-muon-int2-overlap",
    HETERO_NAME,
)


@dataclass(frozen=True)
class Mode:
    """How big the runs are."""

    model: ModelSpec
    steps: int  # inner steps per worker, and DDP steps: the same tokens for every config
    seeds: tuple[int, ...]
    eval_batches: int  # validation batches (of batch_size sequences), the same for every config
    hetero_rounds: int
    round_seconds: float  # the time-budgeted runs' compute per round
    configs: tuple[str, ...] | None = None  # what it runs by default (None: every config and hetero)


MODEL = ModelSpec(n_layer=2, n_head=4, n_embd=64, block_size=64)
DEFAULT = Mode(MODEL, 1200, (0, 1, 2), 16, 10, 8.0)
QUICK = Mode(MODEL, 200, (0,), 8, 4, 2.5, QUICK_CONFIGS)


# -- the size sweep ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """A model size for ``--sizes``: the model and its token budget (steps per worker, 32 sequences each).

    The CPU sizes widen the default model (2 layers, 4 heads, 64 bytes of context) 2× at a time, which
    multiplies its parameters by about 4, and give each about 1.5× the steps of the one below, in whole
    rounds (tokens scaled with size, though more slowly than compute-optimal training would, to fit 2
    cores). The GPU sizes are a start for a sweep on one: their step counts are not measured.
    """

    name: str
    model: ModelSpec
    steps: int
    eval_batches: int = 8

    def steps_for(self, quick: bool) -> int:
        """Its steps, or with ``--quick`` a third of them, in whole rounds of every config's H."""
        h = math.lcm(*(c.inner_steps for c in BASELINES + CONFIGS))
        return max(1, round(self.steps / 3 / h)) * h if quick else self.steps

    @property
    def params(self) -> int:
        count = parameter_count(TrainingSpec(recipe="char-gpt", model=self.model))
        assert count is not None
        return count


SIZES = {
    s.name: s
    for s in (
        Size("0.1M", ModelSpec(n_layer=2, n_head=4, n_embd=64, block_size=64), 300),
        Size("0.4M", ModelSpec(n_layer=2, n_head=4, n_embd=128, block_size=64), 450),
        Size("1.6M", ModelSpec(n_layer=2, n_head=4, n_embd=256, block_size=64), 700),
        Size("20M", ModelSpec(n_layer=6, n_head=8, n_embd=512, block_size=256), 3000, 16),
        # where the published gap is known (DiLoCo at 4 workers: +2.0%); scripts/gpu-check runs it
        Size("35M", ModelSpec(n_layer=9, n_head=8, n_embd=576, block_size=256), 3500, 16),
        Size("50M", ModelSpec(n_layer=12, n_head=8, n_embd=576, block_size=256), 4000, 16),
    )
}
CPU_SIZES = ("0.1M", "0.4M", "1.6M")
SIZE_CONFIGS = (
    "ddp-adamw",
    "ddp-muon",
    "diloco-adamw-fp32",
    "diloco-adamw-int2",
    "diloco-muon-fp32",
    "diloco-muon-int2",
)
SIZE_LINK = Link()  # unmetered: the sweep measures loss
# "Scaling Laws for DiLoCo" (Charles et al., 2025), Table 4, M = 4 replicas: DiLoCo's evaluation loss
# over DDP's, minus one, at each model size (parameters)
SCALING_LAW_M4 = ((35e6, 0.020), (90e6, 0.015), (2.4e9, 0.003))


@dataclass
class Run:
    """One config, one seed (and, in the size sweep, one size)."""

    name: str
    seed: int
    val_loss: float
    bytes_per_worker: float  # sent + received, the mean over workers
    wall_s: float  # round 0 published -> last round published (DDP: the training loop)
    utilization: float  # compute time / wall time, the mean over workers
    curve: list[tuple[float, float, float]] = field(default_factory=list)  # (bytes, seconds, val loss)
    steps_per_round: float = 0.0  # of the fastest worker
    size: str = ""  # the size's name, in the size sweep


def spec_for(mode: Mode, seed: int, config: Config, **overrides: Any) -> TrainingSpec:
    fields = {
        "recipe": "char-gpt",
        "model": mode.model,
        "seed": seed,
        "eval_batches": mode.eval_batches,
        "rounds": max(1, mode.steps // config.inner_steps),
        "inner_steps": config.inner_steps,
        "inner_optimizer": config.optimizer,
        "lr": config.lr,
        "compression": config.compression,
        "outer_lr": config.outer_lr,
        "outer_momentum": config.outer_momentum,
        "overlap": config.overlap,
        "round_timeout_s": 3600,  # a slow worker is waited for unless the rounds are time-budgeted
        "verification": {"audit_rate": AUDIT_RATE},
    }
    return TrainingSpec(**{**fields, **overrides})


def run_diloco(name: str, spec: TrainingSpec, corpus: bytes, slowdown: float = 1.0, link: Link = LINK) -> Run:
    # the slow worker spins: with more workers than cores, a sleeping one would speed the others up
    slow = WorkerOptions(link=link, slowdown=slowdown, spin=True)
    options = [slow, *[WorkerOptions(link=link)] * (WORKERS - 1)]
    result = run_local(spec, corpus, WORKERS, options=options, poll_interval_s=POLL_S, timeout_s=6 * 3600)
    return summarise(name, spec, result)


def summarise(name: str, spec: TrainingSpec, result: LocalResult) -> Run:
    """A run's numbers from its rounds and its workers' links.

    The loss curve's bytes are exact at its end (the links' count); before that, the join and the
    messages are drawn as if all spent before round 1, and each round adds its blobs.
    """
    rounds = result.rounds
    metered = statistics.mean(w.link.bytes_total for w in result.workers)
    per_round = [r.uploaded / max(1, r.contributions) + r.update for r in rounds]
    spent = metered - sum(per_round)
    curve = []
    for r, cost in zip(rounds, per_round, strict=True):
        spent += cost
        curve.append((spent, r.seconds - rounds[0].seconds, r.val_loss))
    tokens_per_step = spec.batch_size * spec.model.block_size
    fastest = max(w.summary.tokens / max(1, len(w.summary.contributed)) for w in result.workers)
    return Run(
        name=name,
        seed=spec.seed,
        val_loss=rounds[-1].val_loss,
        bytes_per_worker=metered,
        wall_s=rounds[-1].seconds - rounds[0].seconds,
        utilization=statistics.mean(w.summary.utilization for w in result.workers),
        curve=curve,
        steps_per_round=fastest / tokens_per_step,
    )


def run_baseline(mode: Mode, seed: int, corpus: bytes, config: Config, link: Link = LINK) -> Run:
    spec = spec_for(mode, seed, config)
    result = run_ddp(spec, corpus, WORKERS, mode.steps, link, eval_every=config.inner_steps)
    return Run(
        config.name,
        seed,
        result.val_loss,
        result.bytes_per_worker,
        result.wall_s,
        result.utilization,
        result.curve,
    )


def run_config(mode: Mode, seed: int, corpus: bytes, config: Config, link: Link = LINK) -> Run:
    # DiLoCo trains rounds × H steps, DDP ``mode.steps``: they must be the same tokens
    assert mode.steps % config.inner_steps == 0, f"{mode.steps} steps: not whole rounds of {config.name}"
    if config.ddp:
        return run_baseline(mode, seed, corpus, config, link)
    return run_diloco(config.name, spec_for(mode, seed, config), corpus, link=link)


def run_hetero(mode: Mode, seed: int, corpus: bytes) -> list[Run]:
    """Equal workers and one slow one with time-budgeted rounds, then the slow one synchronously."""
    budgeted = spec_for(
        mode,
        seed,
        HETERO,
        rounds=mode.hetero_rounds,
        inner_steps=100_000,
        round_seconds=mode.round_seconds,
    )
    equal = run_diloco("hetero-equal-budgeted", budgeted, corpus)
    slow = run_diloco("hetero-slow-budgeted", budgeted, corpus, slowdown=SLOWDOWN)
    steps = max(1, round(equal.steps_per_round))  # what a fast worker does in a budgeted round
    synchronous = spec_for(mode, seed, HETERO, rounds=mode.hetero_rounds, inner_steps=steps, overlap=False)
    return [equal, slow, run_diloco("hetero-slow-synchronous", synchronous, corpus, slowdown=SLOWDOWN)]


def time_to(loss: float, curve: list[tuple[float, float, float]]) -> float | None:
    """Seconds until the curve first reaches ``loss``, interpolated between rounds; None if it never does."""
    if curve and curve[0][2] <= loss:
        return curve[0][1]
    for (_, t0, l0), (_, t1, l1) in itertools.pairwise(curve):
        if l1 <= loss:  # and l0 > loss, or we would have returned already
            return t0 + (t1 - t0) * (l0 - loss) / (l0 - l1)
    return None


def hetero_slowdowns(equal: Run, slow: Run, synchronous: Run) -> dict[str, float | None]:
    target = max(equal.val_loss, slow.val_loss)  # a loss both budgeted runs reach
    reference = time_to(target, equal.curve)
    ratios = {
        key: (t / reference if (t := time_to(target, run.curve)) is not None and reference else None)
        for key, run in (("slowdown", slow), ("sync_slowdown", synchronous))
    }
    return {"target_loss": target, **ratios}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(runs: list[Run], name: str) -> dict[str, Any]:
    """A config's numbers over its seeds: mean and standard deviation of each; for a config of
    ``BY_NAME``, what it is (``kind``: ddp or diloco) and its ``optimizer``."""
    mine = [r for r in runs if r.name == name]
    row: dict[str, Any] = {"name": name, "seeds": [r.seed for r in mine]}
    if (config := BY_NAME.get(name)) is not None:
        row |= {"kind": "ddp" if config.ddp else "diloco", "optimizer": config.optimizer}
    for key in ("val_loss", "bytes_per_worker", "wall_s", "utilization"):
        row[key], row[f"{key}_std"] = mean_std([getattr(r, key) for r in mine])
    return row


# -- comparisons (pure: tests/bench/test_diloco_vs_ddp.py) ------------------------------------------
def against(row: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    """A DiLoCo row's point against one DDP row: its loss gap (val loss / DDP's − 1) and how many times
    fewer bytes it moved."""
    return {
        "name": row["name"],
        "loss_gap": row["val_loss"] / ddp["val_loss"] - 1,
        "bytes_ratio_vs_ddp": ddp["bytes_per_worker"] / row["bytes_per_worker"],
    }


def headline(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The most compressed point within MAX_GAP, and the frontier: the points no other dominates (no
    worse on both loss gap and bytes ratio, better on one; two configs that move the same bytes are
    told apart by their loss)."""
    qualified = [p for p in points if p["loss_gap"] <= MAX_GAP]
    best = max(qualified, key=lambda p: p["bytes_ratio_vs_ddp"], default=None)
    frontier = [p for p in points if not any(_dominates(o, p) for o in points)]
    return {
        "best_config": best and best["name"],
        "best_bytes_ratio_vs_ddp": best and best["bytes_ratio_vs_ddp"],
        "loss_gap": best and best["loss_gap"],
        "frontier": sorted(frontier, key=lambda p: p["loss_gap"]),
    }


def _dominates(o: dict[str, Any], p: dict[str, Any]) -> bool:
    """``o`` is no worse than ``p`` on both loss gap and bytes ratio, and better on one."""
    gap, ratio = "loss_gap", "bytes_ratio_vs_ddp"
    return o[gap] <= p[gap] and o[ratio] >= p[ratio] and (o[gap] < p[gap] or o[ratio] > p[ratio])


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each DiLoCo row against the better DDP row (the lower validation loss) and against its own
    optimizer's DDP; the headline (``headline``) against the better one, and ``per_optimizer`` the same
    against each optimizer's own DDP.

    Each DiLoCo row gains ``loss_gap`` and ``bytes_ratio_vs_ddp`` (against the better DDP) and, when its
    optimizer's DDP ran, ``loss_gap_vs_own_ddp`` and ``bytes_ratio_vs_own_ddp``. Without a DDP row
    there is nothing to compare against: every figure is None.
    """
    baselines = [r for r in rows if r["kind"] == "ddp"]
    diloco = [r for r in rows if r["kind"] == "diloco"]
    ddp = min(baselines, key=lambda r: r["val_loss"], default=None)
    if ddp is None:
        return {"ddp_baseline": None, **headline([]), "per_optimizer": {}}
    own = {r["optimizer"]: r for r in baselines}
    for row in diloco:
        point = against(row, ddp)
        row["loss_gap"], row["bytes_ratio_vs_ddp"] = point["loss_gap"], point["bytes_ratio_vs_ddp"]
        if row["optimizer"] in own:
            point = against(row, own[row["optimizer"]])
            row["loss_gap_vs_own_ddp"], row["bytes_ratio_vs_own_ddp"] = (
                point["loss_gap"],
                point["bytes_ratio_vs_ddp"],
            )
    per_optimizer = {
        optimizer: {
            "ddp": own[optimizer]["name"],
            **headline([against(r, own[optimizer]) for r in diloco if r["optimizer"] == optimizer]),
        }
        for optimizer in dict.fromkeys(r["optimizer"] for r in diloco)
        if optimizer in own
    }
    return {
        "ddp_baseline": ddp["name"],
        **headline([against(r, ddp) for r in diloco]),
        "per_optimizer": per_optimizer,
    }


def overlap_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each overlapped DiLoCo row (through ``compare``) beside the same config without the overlap: its
    utilization, and the points of loss gap (against the better DDP) the overlap cost (None where the
    config without it did not run)."""
    by_name = {r["name"]: r for r in rows}
    costs = []
    for row in rows:
        if row.get("kind") != "diloco" or not row["name"].endswith("-overlap") or "loss_gap" not in row:
            continue
        without = by_name.get(row["name"].removesuffix("-overlap"))
        costs.append(
            {
                "name": row["name"],
                "utilization": row["utilization"],
                "without": without["name"] if without else None,
                "utilization_without": without["utilization"] if without else None,
                "gap_cost": row["loss_gap"] - without["loss_gap"] if without else None,
            }
        )
    return costs


def falls_with_size(points: list[tuple[float, float]]) -> bool | None:
    """Whether the gap falls with size: each larger model's gap below the next smaller one's.
    ``points`` are (parameters, gap); None with fewer than two sizes."""
    if len(points) < 2:
        return None
    gaps = [gap for _, gap in sorted(points)]
    return all(b < a for a, b in itertools.pairwise(gaps))


def size_gaps(per_size: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """From each size's ``{"params", "configs": rows}`` (rows through ``compare``): each DiLoCo config's
    gap by size, against its own optimizer's DDP (``own``) and against the better DDP (``better``),
    keyed by optimizer and then compression (the name after ``diloco-<optimizer>-``), with whether it
    falls with size; ``falls_for_every_config`` over all of them (None if any is undecided)."""
    gaps: dict[str, dict[str, dict[str, Any]]] = {}
    for size, entry in per_size.items():
        for row in entry["configs"]:
            if row.get("kind") != "diloco" or "loss_gap" not in row:
                continue
            compression = row["name"].removeprefix(f"diloco-{row['optimizer']}-")
            into = gaps.setdefault(row["optimizer"], {}).setdefault(compression, {"own": {}, "better": {}})
            into["better"][size] = row["loss_gap"]
            if "loss_gap_vs_own_ddp" in row:
                into["own"][size] = row["loss_gap_vs_own_ddp"]
    verdicts = []
    for by_compression in gaps.values():
        for into in by_compression.values():
            for key in ("own", "better"):
                points = [(per_size[s]["params"], g) for s, g in into[key].items()]
                into[f"falls_{key}"] = falls_with_size(points)
            verdicts.append(into["falls_own"])
    every = None if not verdicts or None in verdicts else all(verdicts)
    return {"gaps": gaps, "falls_for_every_config": every}


# -- results files ----------------------------------------------------------------------------------
def results_stem(base: str, data: str, quick: bool) -> str:
    """``base``, then the corpus's directory name unless it is the stdlib, then ``-quick``."""
    stem = base
    if data != "stdlib":
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(data).expanduser().resolve().name) or "data"
        stem += f"-{name}"
    return stem + ("-quick" if quick else "")


def prior_runs(path: Path, settings: dict[str, Any]) -> tuple[list[Run], list[dict[str, Any]]]:
    """The runs (and heterogeneous per-seed results) of an earlier results file with the same
    settings, to merge this run's into; nothing if there is none or its settings differ. In the size
    sweep's settings, ``sizes`` defines each size: a size defined otherwise drops only its own runs."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return [], []
    now = json.loads(json.dumps(settings))
    before = earlier.get("settings", {})
    if {k: v for k, v in before.items() if k != "sizes"} != {k: v for k, v in now.items() if k != "sizes"}:
        print(f"{path.name} has other settings: starting over", flush=True)
        return [], []
    kept = {n for n, d in now.get("sizes", {}).items() if before.get("sizes", {}).get(n) == d}
    runs = [Run(**r) for r in earlier.get("runs", []) if not r.get("size") or r["size"] in kept]
    print(f"merging with the {len(runs)} runs in {path.name}", flush=True)
    return runs, earlier.get("hetero", {}).get("per_seed", [])


def merge(earlier: list[Run], new: list[Run]) -> list[Run]:
    """``earlier``'s runs but those ``new`` redoes (the same size, config and seed), then ``new``'s."""
    redone = {(r.size, r.name, r.seed) for r in new}
    return [r for r in earlier if (r.size, r.name, r.seed) not in redone] + new


def merge_hetero(earlier: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    redone = {h["seed"] for h in new}
    return sorted([h for h in earlier if h.get("seed") not in redone] + new, key=lambda h: h.get("seed", -1))


def plot(runs: list[Run], path: Path) -> None:
    """Loss against bytes per worker (the compared configs) and against wall time (all runs), by seed.
    A colour per variant (ddp, fp32, int8, ...), the same for both optimizers: AdamW's lines solid, Muon's
    dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    by_bytes, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = list(dict.fromkeys(r.name for r in runs))
    variant = {name: re.sub(r"-(adamw|muon)\b", "", name) for name in names}
    colours = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(variant.values()))}
    for name in names:
        colour = colours[variant[name]]
        for j, run in enumerate(r for r in runs if r.name == name):
            style = {
                "color": colour,
                "alpha": 0.9 if j == 0 else 0.35,
                "label": name if j == 0 else None,
                "linestyle": "--" if "-muon" in name else "-",
            }
            points = [(b, t, v) for b, t, v in run.curve if v is not None]
            if not name.startswith("hetero"):
                by_bytes.plot([b for b, _, _ in points], [v for _, _, v in points], marker="o", ms=2, **style)
            by_time.plot([t for _, t, _ in points], [v for _, _, v in points], **style)
    by_bytes.set(xscale="log", xlabel="bytes per worker, sent + received", ylabel="validation loss")
    by_time.set(xlabel="wall seconds", ylabel="validation loss")
    for ax, title in ((by_bytes, "loss against communication"), (by_time, "loss against time")):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def plot_sizes(summary: dict[str, Any], path: Path) -> None:
    """Each DiLoCo config's gap against parameters (log axis): against its own optimizer's DDP (left,
    with the scaling-law paper's M = 4 points) and against the better DDP (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5), dpi=110)
    FigureCanvasAgg(fig)
    own, better = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    params = {name: entry["params"] for name, entry in summary["sizes"].items()}
    i = 0
    for optimizer, by_compression in summary["gaps"].items():
        for compression, gaps in by_compression.items():
            label = f"diloco-{optimizer}-{compression}"
            style = {"color": f"C{i}", "marker": "o", "linestyle": "--" if optimizer == "muon" else "-"}
            for ax, key in ((own, "own"), (better, "better")):
                points = sorted((params[s], 100 * g) for s, g in gaps[key].items())
                ax.plot([p for p, _ in points], [g for _, g in points], label=label, **style)
            i += 1
    own.plot(
        [p for p, _ in SCALING_LAW_M4],
        [100 * g for _, g in SCALING_LAW_M4],
        "k*",
        ms=10,
        label="Scaling Laws for DiLoCo, Table 4, M = 4",
    )
    for ax, title in (
        (own, "gap against its own optimizer's DDP"),
        (better, "gap against the better DDP"),
    ):
        ax.set(xscale="log", xlabel="parameters", ylabel="validation loss gap (%)", title=title)
        ax.axhline(0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


# -- the runs ---------------------------------------------------------------------------------------
def run_seed(mode: Mode, seed: int, corpus: bytes, selected: list[str]) -> Iterator[tuple[Run, dict | None]]:
    """The selected configs (and the heterogeneous case if selected), for one seed, each run as it ends;
    the heterogeneous case's last run comes with its seed's slowdowns."""
    for config in BASELINES + CONFIGS:
        if config.name in selected:
            run = run_config(mode, seed, corpus, config)
            _report(run)
            yield run, None
    if HETERO_NAME not in selected:
        return
    hetero = run_hetero(mode, seed, corpus)
    for run in hetero:
        _report(run)
    slowdowns = {"seed": seed, **hetero_slowdowns(*hetero)}
    print(f"  seed {seed}: heterogeneous {json.dumps(slowdowns)}", flush=True)
    for run in hetero[:-1]:
        yield run, None
    yield hetero[-1], slowdowns


def _report(run: Run) -> None:
    size = f"{run.size:>5s} " if run.size else ""
    print(
        f"  {size}seed {run.seed} {run.name:32s} val {run.val_loss:.4f}  "
        f"{run.bytes_per_worker / 1e6:9.2f} MB/worker  {run.wall_s:7.1f}s  utilization {run.utilization:.1%}",
        flush=True,
    )


def _names(text: str | None, known: list[str], default: tuple[str, ...] | None, what: str) -> list[str]:
    """The comma-separated names of ``text`` (or ``default``; None: all of ``known``), checked."""
    if text is None:
        return list(default) if default is not None else list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 200 steps, QUICK_CONFIGS only")
    parser.add_argument("--data", default="stdlib", help="a directory of text files (default: the stdlib)")
    parser.add_argument("--configs", help="comma-separated config names ('hetero': the heterogeneous case)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the mode's)")
    parser.add_argument("--fresh", action="store_true", help="don't merge into an earlier results file")
    parser.add_argument(
        "--sizes",
        nargs="?",
        const=",".join(CPU_SIZES),
        help=f"the gap against model size, at these named sizes (alone: {','.join(CPU_SIZES)}; "
        f"known: {','.join(SIZES)})",
    )
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
    corpus = build_corpus(args.data, 2_000_000, text_extensions(args.data))
    label = "quick" if args.quick else "default"
    print(f"{label} mode: {len(corpus):,} bytes of text from {args.data}", flush=True)
    summary = main_sizes(args, corpus, seeds) if args.sizes is not None else main_configs(args, corpus, seeds)
    print(json.dumps(summary))


def main_configs(args: argparse.Namespace, corpus: bytes, seeds: tuple[int, ...] | None) -> dict[str, Any]:
    mode = QUICK if args.quick else DEFAULT
    known = [c.name for c in BASELINES + CONFIGS] + [HETERO_NAME]
    selected = _names(args.configs, known, mode.configs, "configs")
    settings = _settings(mode, args)
    path = RESULTS / f"{results_stem('diloco_vs_ddp', args.data, args.quick)}.json"
    runs, hetero = prior_runs(path, settings) if not args.fresh else ([], [])
    summary = _summary(settings, runs, hetero)
    for seed in seeds or mode.seeds:
        for run, slowdowns in run_seed(mode, seed, corpus, selected):
            runs = merge(runs, [run])
            hetero = merge_hetero(hetero, [slowdowns]) if slowdowns else hetero
            summary = _summary(settings, runs, hetero)
            write_results(path, summary, runs)  # after every run: a long one cut short keeps what it measured
    return summary


def write_results(path: Path, summary: dict[str, Any], runs: list[Run]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**summary, "runs": [asdict(r) for r in runs]}, indent=1))
    plot(runs, path.with_suffix(".png"))


def _described(configs: list[Config]) -> list[dict[str, Any]]:
    return [asdict(c) | {"compression": c.compression.model_dump()} for c in configs]


def _settings(mode: Mode, args: argparse.Namespace) -> dict[str, Any]:
    """What a results file's runs depend on: a file with other settings is not merged into."""
    return {
        "mode": "quick" if args.quick else "default",
        "data": args.data,
        "workers": WORKERS,
        "link": {"bandwidth_bps": LINK.bandwidth_bps, "latency_s": LINK.latency_s},
        "model": mode.model.model_dump(),
        "steps_per_worker": mode.steps,
        "eval_batches": mode.eval_batches,
        "audit_rate": AUDIT_RATE,
        "baselines": _described(BASELINES),
        "configs": _described(CONFIGS),  # DiLoCo's only (gpuflex.sim.bandwidth reads them)
        "hetero": {
            "config": HETERO.name,
            "rounds": mode.hetero_rounds,
            "round_seconds": mode.round_seconds,
            "slowdown": SLOWDOWN,
        },
    }


def _summary(settings: dict[str, Any], runs: list[Run], hetero: list[dict[str, Any]]) -> dict[str, Any]:
    ran = {r.name for r in runs}
    rows = [aggregate(runs, c.name) for c in BASELINES + CONFIGS if c.name in ran]
    summary: dict[str, Any] = {"configs": rows, **compare(rows)}
    summary["overlap"] = overlap_costs(rows)
    if hetero:
        hetero_rows = [
            aggregate(runs, name)
            for name in dict.fromkeys(r.name for r in runs if r.name.startswith("hetero"))
        ]
        for key in ("slowdown", "sync_slowdown"):
            reached = [h[key] for h in hetero if h[key] is not None]
            summary[f"hetero_{key}"], summary[f"hetero_{key}_std"] = (
                mean_std(reached) if reached else (None, None)
            )
            summary[f"hetero_{key}_reached"] = f"{len(reached)}/{len(hetero)} seeds"
        summary["hetero"] = {"runs": hetero_rows, "per_seed": hetero}
    summary["settings"] = settings
    return summary


def main_sizes(args: argparse.Namespace, corpus: bytes, seeds: tuple[int, ...] | None) -> dict[str, Any]:
    sizes = _names(args.sizes, list(SIZES), None, "sizes")
    known = [c.name for c in BASELINES + CONFIGS]
    selected = _names(args.configs, known, SIZE_CONFIGS, "configs")
    settings = {
        "mode": "quick" if args.quick else "default",
        "data": args.data,
        "workers": WORKERS,
        "link": {"bandwidth_bps": SIZE_LINK.bandwidth_bps, "latency_s": SIZE_LINK.latency_s},
        "audit_rate": AUDIT_RATE,
        "sizes": {s.name: asdict(s) | {"model": s.model.model_dump()} for s in SIZES.values()},
        "baselines": _described(BASELINES),
        "configs": _described(CONFIGS),
    }
    path = RESULTS / f"{results_stem('diloco_sizes', args.data, args.quick)}.json"
    runs, _ = prior_runs(path, settings) if not args.fresh else ([], [])
    for seed in seeds or (0,):
        for name in sizes:
            size = SIZES[name]
            steps = size.steps_for(args.quick)
            mode = Mode(size.model, steps, (seed,), size.eval_batches, 0, 0.0)
            for config in BASELINES + CONFIGS:
                if config.name in selected:
                    run = run_config(mode, seed, corpus, config, link=SIZE_LINK)
                    run.size = name
                    _report(run)
                    runs = merge(runs, [run])
                    summary = _sizes_summary(settings, runs)
                    write_results_sizes(path, summary, runs)  # after every run: a sweep cut short keeps it
    return {
        "gaps": summary["gaps"],
        "falls_for_every_config": summary["falls_for_every_config"],
        "params": {name: entry["params"] for name, entry in summary["sizes"].items()},
        "ddp_baseline": {name: entry["ddp_baseline"] for name, entry in summary["sizes"].items()},
        "scaling_law_m4": summary["scaling_law_m4"],
    }


def _sizes_summary(settings: dict[str, Any], runs: list[Run]) -> dict[str, Any]:
    per_size: dict[str, dict[str, Any]] = {}
    for name, size in SIZES.items():  # smallest first
        mine = [r for r in runs if r.size == name]
        if not mine:
            continue
        ran = {r.name for r in mine}
        rows = [aggregate(mine, c.name) for c in BASELINES + CONFIGS if c.name in ran]
        compared = compare(rows)
        per_size[name] = {
            "params": size.params,
            "ddp_baseline": compared["ddp_baseline"],
            "configs": rows,
        }
    return {
        **size_gaps(per_size),
        "scaling_law_m4": [{"params": p, "loss_gap": g} for p, g in SCALING_LAW_M4],
        "sizes": per_size,
        "settings": settings,
    }


def write_results_sizes(path: Path, summary: dict[str, Any], runs: list[Run]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**summary, "runs": [asdict(r) for r in runs]}, indent=1))
    plot_sizes(summary, path.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
