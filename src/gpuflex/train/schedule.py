"""The inner learning rate over a job: linear warm-up, then a cosine decay to a tenth.

It is a function of the job's progress, ``(round + share of the round done) / rounds``, not of a step
count: with time-budgeted rounds nobody knows the job's steps in advance, and every worker, fast or
slow, must be at the same point of the schedule in the same round. A decayed lr at the end also
makes the replicas' last rounds agree, so the average loses little.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gpuflex.protocol.spec import TrainingSpec

if TYPE_CHECKING:
    from gpuflex.train.optimizers import InnerOptimizer

FLOOR = 0.1  # the cosine ends at this share of the peak lr


def lr_factor(spec: TrainingSpec, progress: float) -> float:
    """The share of ``spec.lr`` to use at ``progress`` (0 at the job's start, 1 at its end)."""
    progress = min(max(progress, 0.0), 1.0)
    if spec.lr_schedule == "constant":
        return 1.0
    if progress < spec.warmup:
        return max(progress / spec.warmup, 0.01)
    decay = (progress - spec.warmup) / (1 - spec.warmup)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * decay))


def lr_range(spec: TrainingSpec, round: int) -> tuple[float, float]:
    """The least and greatest factor anywhere in ``round``: a time-budgeted step may fall at any point
    of it. The schedule rises, then falls, so the least is at an end of the round and the greatest at an
    end or, in the round where warm-up ends, at the peak between them."""
    start, end = round / spec.rounds, (round + 1) / spec.rounds
    ends = [lr_factor(spec, start), lr_factor(spec, end)]
    peak = [lr_factor(spec, spec.warmup)] if start <= spec.warmup <= end else []
    return min(ends), max(ends + peak)


def lr_share(spec: TrainingSpec, round: int, steps: int) -> float:
    """The share of a full round's learning-rate sum that its first ``steps`` steps take: a delta's norm
    grows with it, not with the steps (in warm-up, half a round's steps move the model a quarter as far)."""
    factors = [lr_factor(spec, (round + k / spec.inner_steps) / spec.rounds) for k in range(spec.inner_steps)]
    return sum(factors[: max(steps, 0)]) / sum(factors)


def set_lr(optimizer: InnerOptimizer, spec: TrainingSpec, progress: float) -> None:
    """Put every parameter group of ``optimizer`` at the schedule's lr for ``progress``."""
    factor = lr_factor(spec, progress)
    for group in optimizer.param_groups:
        group["lr"] = spec.lr * factor
