"""Calibration: a quote's duration corrected by what the network's finished jobs actually took.

The pricing model (``pricing.round_seconds``) predicts a round from benchmarked TFLOPS at an assumed
efficiency, and knows nothing of a job's start (placement, processes, the model and data fetched and
loaded, the first evaluation) or its end (the last evaluation and checkpoint). Both errors are
measured on every completed job, apart, because they scale differently:

- ``speed``: a steady round's measured seconds ÷ the model's prediction for the nodes that ran it
  (the median interval between published rounds, so a first round slowed by workers still loading
  does not count as compute);
- ``fixed_s``: the job's wall time (submitted to finished) less its rounds at that steady pace.

A time-budgeted job's rounds end at their budget whatever the nodes' speed, so its speed says how far
a round overruns its budget (evaluation, exchange), not how fast a node computes: the two kinds of job
are calibrated on their own kind's speeds, and on every job's fixed seconds.

A new quote's expected duration is ``fixed_s + rounds x predicted round x speed`` at the history's
medians, times the history's mean error of that formula on its own jobs (``bias``). Its range is a
prediction interval on that error's logarithm: ``e^±spread``, ``spread`` being the errors' standard
deviation times Student's t for ``COVERAGE`` with n - 1 degrees of freedom times sqrt(1 + 1/n), so a
short history gives a wide range and a long one the errors' own width. Until ``MIN_JOBS`` jobs have
completed, the model's constants stand (``Calibration.prior``). Pure: the coordinator gathers the
timings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_JOBS = 3  # fewer completed jobs than this: too few to trust over the model's constants
HISTORY = 50  # the newest jobs a calibration reads: the network changes, old jobs stop describing it
COVERAGE = 0.8  # the share of jobs a quote's range should hold: its ends are the 10th and 90th percentiles

# Before any job has completed. A job's start and end took 5-10 s on the project's 2-core machine for
# char-gpt jobs (bench/quotes.py), more for a pretrained model that is fetched and loaded: 20 s. The
# range, x/÷ 2.5, is about what the efficiencies 0.3-0.9 around 0.7 gave the model's round before.
PRIOR_FIXED_S = 20.0
PRIOR_SPREAD = math.log(2.5)
PRIOR_BUDGET_OVERRUN = 1.1  # a time-budgeted round over its budget: evaluation, exchange


@dataclass(frozen=True)
class JobTiming:
    """What one completed job took, beside what the model predicted for the nodes it ran on."""

    wall_s: float  # submitted to finished
    rounds: int  # training rounds published
    steady_round_s: float  # median seconds between consecutive published rounds
    predicted_round_s: float  # ``pricing.round_seconds`` on its slowest worker at ``EFFICIENCY``
    time_budgeted: bool  # ``training.round_seconds`` set: rounds end at a budget, not after their steps

    @property
    def speed(self) -> float:
        return self.steady_round_s / self.predicted_round_s

    @property
    def fixed_s(self) -> float:
        return max(0.0, self.wall_s - self.rounds * self.steady_round_s)


@dataclass(frozen=True)
class Calibration:
    """A quote's correction: the seconds to start and finish, the speed factor on the model's rounds,
    the history's mean error factor, and the range's half-width (a log factor)."""

    fixed_s: float
    speed: float
    bias: float = 1.0
    spread: float = PRIOR_SPREAD
    jobs: int = 0  # how many completed jobs it was read from; 0: the prior

    @classmethod
    def prior(cls, *, time_budgeted: bool) -> Calibration:
        """The model's own: rounds as predicted (a budgeted one a little over its budget)."""
        return cls(PRIOR_FIXED_S, PRIOR_BUDGET_OVERRUN if time_budgeted else 1.0)

    @classmethod
    def of(cls, timings: Sequence[JobTiming], *, time_budgeted: bool) -> Calibration:
        """From the newest ``HISTORY`` timings (newest first): the fixed seconds of all, the speed of
        those paced as the quoted job is (the prior's with fewer than ``MIN_JOBS`` of them), and the
        error of both over every job; the prior with fewer than ``MIN_JOBS`` jobs in all."""
        # a job whose clock did not move (its rounds at one instant) says nothing of speed, and its
        # logarithm would be undefined
        usable = [
            t
            for t in timings[:HISTORY]
            if t.rounds > 0 and min(t.wall_s, t.steady_round_s, t.predicted_round_s) > 0
        ]
        if len(usable) < MIN_JOBS:
            return cls.prior(time_budgeted=time_budgeted)
        fixed = statistics.median(t.fixed_s for t in usable)
        speeds = {
            kind: _speed([t for t in usable if t.time_budgeted == kind], kind) for kind in (False, True)
        }
        errors = [
            math.log(t.wall_s / (fixed + t.rounds * t.predicted_round_s * speeds[t.time_budgeted]))
            for t in usable
        ]
        n = len(errors)
        spread = statistics.stdev(errors) * _t(COVERAGE, n - 1) * math.sqrt(1 + 1 / n)
        return cls(fixed, speeds[time_budgeted], math.exp(statistics.fmean(errors)), spread, n)

    def duration_s(self, end: int, rounds: float, predicted_round_s: float) -> float:
        """Seconds for ``rounds`` rounds the model predicts at ``predicted_round_s``: ``end`` 0 is the
        low end, 1 the expected, 2 the high end."""
        expected = (self.fixed_s + rounds * predicted_round_s * self.speed) * self.bias
        return expected * math.exp((end - 1) * self.spread)

    def describe(self) -> str:
        span = f"range x/÷ {math.exp(self.spread):.2f}"
        if not self.jobs:
            uncalibrated = f"not yet calibrated: fewer than {MIN_JOBS} jobs"
            return f"≈ {self.fixed_s:.0f} s to start and finish, {span} ({uncalibrated})"
        return (
            f"calibrated on the network's last {self.jobs} jobs: ≈ {self.fixed_s:.0f} s to start and finish, "
            f"rounds at {self.speed:.2f}x the model's time, {span}"
        )


def _speed(alike: list[JobTiming], time_budgeted: bool) -> float:
    """The median speed of jobs paced alike; the prior's with too few of them."""
    if len(alike) < MIN_JOBS:
        return Calibration.prior(time_budgeted=time_budgeted).speed
    return statistics.median(t.speed for t in alike)


def _t(coverage: float, dof: int) -> float:
    """Student's t quantile for a two-sided ``coverage`` interval (Cornish-Fisher's expansion of the
    normal quantile: within 0.5% of the exact value from 2 degrees of freedom up)."""
    z = statistics.NormalDist().inv_cdf((1 + coverage) / 2)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
    )
    return z + sum(term / dof ** (i + 1) for i, term in enumerate(terms))
