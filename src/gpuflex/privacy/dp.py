"""Client-level differential privacy in the DP-FedAvg manner: clipping, Gaussian noise, the ε ledger.

Each owner's contribution (a pseudo-gradient, one per round) is clipped to L2 norm ``clip``; the sum
gets Gaussian noise of standard deviation ``noise_multiplier * clip``. In plain mode the aggregator adds
it to the sum; under secure aggregation nobody sees the sum before it is noised, so each worker adds its
share, ``N(0, (z*C)^2 / shares)``. Split it over the round's threshold ``t``, not over ``n``: the sum of
any ``t`` or more survivors' shares then carries at least the full variance (dropouts never leave the
sum under-noised; with no dropouts it is over-noised by ``n / t``).

Every owner takes part in every round (sampling rate q = 1), so k rounds are the k-fold composition of
the Gaussian mechanism; ``Accountant`` converts it to (ε, δ) with dp-accounting's RDP accountant, and a
job stops before the round that would take ε past its target (``DPPlan.rounds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from gpuflex.errors import Conflict, SpecError
from gpuflex.protocol.spec import DPSpec

MAX_NOISE_MULTIPLIER = 100.0  # past this the signal is gone; a target needing more is refused
MAX_EPSILON = 100.0  # past this the guarantee says nothing


def l2_norm(delta: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


def clip(delta: dict[str, torch.Tensor], bound: float) -> tuple[dict[str, torch.Tensor], float]:
    """``delta`` scaled to L2 norm at most ``bound`` (unchanged if already within), and its norm before."""
    norm = l2_norm(delta)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in delta.items()}, norm


def noise_std(clip_bound: float, noise_multiplier: float, shares: int = 1) -> float:
    """Standard deviation of one party's noise when ``shares`` parties each add a part of it."""
    if shares < 1:
        raise SpecError(f"noise split over {shares} parties")
    return noise_multiplier * clip_bound / math.sqrt(shares)


def add_noise(
    delta: dict[str, torch.Tensor], std: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """``delta`` plus independent N(0, std^2) on every coordinate (float32 or wider noise)."""
    out = {}
    for k, t in delta.items():
        dtype = t.dtype if t.is_floating_point() and t.element_size() >= 4 else torch.float32
        noise = torch.randn(t.shape, generator=generator, dtype=dtype) * std
        out[k] = (t.to(dtype) + noise).to(t.dtype)
    return out


@lru_cache(maxsize=4096)
def _epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(delta))


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = True) -> None:
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise SpecError(f"privacy.dp.{name} must lie in {bracket}{low}, {high}], not {value}")


@dataclass(frozen=True)
class Accountant:
    """ε spent after k rounds of the Gaussian mechanism at ``noise_multiplier``, q = 1, for ``delta``."""

    noise_multiplier: float
    delta: float

    def __post_init__(self) -> None:
        _check_range("noise_multiplier", self.noise_multiplier, 0.0, MAX_NOISE_MULTIPLIER)
        if not (math.isfinite(self.delta) and 0 < self.delta < 1):
            raise SpecError(f"privacy.dp.delta must lie in (0, 1), not {self.delta}")

    def epsilon(self, rounds: int) -> float:
        if rounds < 0:
            raise SpecError(f"a privacy ledger of {rounds} rounds")
        return 0.0 if rounds == 0 else _epsilon(self.noise_multiplier, rounds, self.delta)

    def rounds_within(self, target_epsilon: float) -> int:
        """The most rounds whose ε stays at or under ``target_epsilon`` (0 if even one exceeds it)."""
        if self.epsilon(1) > target_epsilon:
            return 0
        low, high = 1, 2
        while self.epsilon(high) <= target_epsilon:
            low, high = high, high * 2
        while high - low > 1:  # ε grows with rounds: epsilon(low) <= target < epsilon(high)
            mid = (low + high) // 2
            low, high = (mid, high) if self.epsilon(mid) <= target_epsilon else (low, mid)
        return low


def noise_for_target(target_epsilon: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier (to a tolerance, rounded up) keeping ``rounds`` rounds within ε."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    _check_range("target_epsilon", target_epsilon, 0.0, MAX_EPSILON)
    if rounds < 1:
        raise SpecError(f"a DP plan for {rounds} rounds")
    Accountant(1.0, delta)  # checks delta
    ceiling = Accountant(MAX_NOISE_MULTIPLIER, delta).epsilon(rounds)
    if ceiling > target_epsilon:
        raise SpecError(
            f"privacy.dp.target_epsilon {target_epsilon} over {rounds} rounds needs a noise multiplier "
            f"above {MAX_NOISE_MULTIPLIER} (ε={ceiling:.3g} even there): raise the target or run fewer rounds"
        )
    z = float(
        dp_accounting.calibrate_dp_mechanism(
            rdp_privacy_accountant.RdpAccountant,
            lambda z: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds),
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, MAX_NOISE_MULTIPLIER),
        )
    )
    while Accountant(z, delta).epsilon(rounds) > target_epsilon:  # brentq's tolerance may land just under
        z *= 1.0001
    return z


@dataclass(frozen=True)
class DPPlan:
    """A job's DP settings, resolved: the clip, the noise multiplier and the budget it must stay within."""

    clip: float
    noise_multiplier: float
    delta: float | None = None
    target_epsilon: float | None = None

    @property
    def accountant(self) -> Accountant | None:
        return None if self.delta is None else Accountant(self.noise_multiplier, self.delta)

    @property
    def rounds(self) -> int | None:
        """The most rounds the job may run before its ε would pass the target; None without one."""
        if self.target_epsilon is None or self.accountant is None:
            return None
        return self.accountant.rounds_within(self.target_epsilon)

    def check_round(self, round_number: int) -> None:
        """Refuse to run round ``round_number`` (1-based) if it would take ε past the target."""
        allowed = self.rounds
        if allowed is not None and round_number > allowed:
            spent = self.accountant.epsilon(round_number) if self.accountant else math.inf
            raise Conflict(
                f"round {round_number} would spend ε={spent:.3g} of a target of {self.target_epsilon}: "
                f"the job stops after round {allowed}"
            )


def plan(
    clip: float,
    rounds: int,
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
) -> DPPlan:
    """``privacy.dp`` resolved for a job of ``rounds`` planned rounds; refuses settings out of range.

    ``{clip, noise_multiplier}`` (with ``delta`` to account ε, and ``target_epsilon`` to stop by it), or
    ``{clip, target_epsilon, delta}``: the noise multiplier that keeps all planned rounds within it.
    """
    _check_range("clip", clip, 0.0, math.inf)
    if target_epsilon is not None:
        _check_range("target_epsilon", target_epsilon, 0.0, MAX_EPSILON)
        if delta is None:
            raise SpecError("privacy.dp.target_epsilon needs privacy.dp.delta")
    if noise_multiplier is None:
        if target_epsilon is None:
            raise SpecError("privacy.dp needs noise_multiplier, or target_epsilon and delta")
        noise_multiplier = noise_for_target(target_epsilon, delta, rounds)
    _check_range("noise_multiplier", noise_multiplier, 0.0, MAX_NOISE_MULTIPLIER)
    result = DPPlan(clip, noise_multiplier, delta, target_epsilon)
    accountant = result.accountant  # checks delta
    if accountant is not None and target_epsilon is not None and accountant.epsilon(1) > target_epsilon:
        raise SpecError(
            f"privacy.dp: one round at noise multiplier {noise_multiplier} already spends "
            f"ε={accountant.epsilon(1):.3g}, over the target {target_epsilon}"
        )
    return result


def for_job(dp: DPSpec, rounds: int) -> DPPlan:
    """A job's ``privacy.dp`` resolved for its ``training.rounds``: the same plan every time it is asked
    (the coordinator asks at submit, at each round and for every view; the calibration is the slow part)."""
    return _for_job(dp, rounds)


@lru_cache(maxsize=1024)
def _for_job(dp: DPSpec, rounds: int) -> DPPlan:
    return plan(
        dp.clip,
        rounds,
        noise_multiplier=dp.noise_multiplier,
        target_epsilon=dp.target_epsilon,
        delta=dp.delta,
    )


def rounds_run(dp_plan: DPPlan | None, asked: int) -> int:
    """The rounds a job runs: all it asked for, or fewer when its target ε allows fewer."""
    allowed = dp_plan.rounds if dp_plan is not None else None
    return asked if allowed is None else min(asked, allowed)


def mean_noise_std(clip_bound: float, noise_multiplier: float, weights: list[float]) -> float:
    """The noise on a weighted average ``Σ w_i Δ_i / Σ w_i`` over all of ``weights`` (a fixed denominator),
    each ``Δ_i`` clipped to ``clip_bound``: ``z`` times its sensitivity, the largest owner's share of the
    weight times the clip. Adding or removing one owner's contribution moves the average by at most
    ``w_i / Σ w * clip``; calibrating to the largest ``w_i`` covers every owner (McMahan et al. 2018's
    fixed-denominator estimator, with its bound on the weights as the largest weight itself)."""
    total = sum(weights)
    if not weights or total <= 0 or min(weights) < 0:
        raise SpecError(f"DP noise for an average over the weights {weights}")
    return noise_multiplier * clip_bound * max(weights) / total
