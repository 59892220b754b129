"""DP: clipping, the noise's scale (plain and split), the accountant's values and its refusals."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.errors import Conflict, SpecError
from gpuflex.privacy.dp import Accountant, add_noise, clip, l2_norm, noise_for_target, noise_std, plan


def test_clipping_bounds_the_norm_and_keeps_the_direction() -> None:
    delta = {"a": torch.full((3,), 3.0), "b": torch.full((1,), 4.0)}  # norm sqrt(27 + 16)
    clipped, norm = clip(delta, 1.0)
    assert norm == pytest.approx(math.sqrt(43))
    assert l2_norm(clipped) == pytest.approx(1.0)
    assert torch.allclose(clipped["a"] / clipped["b"], torch.full((3,), 0.75))
    small, _ = clip(delta, 100.0)
    assert all(torch.equal(small[k], delta[k]) for k in delta)
    zero, norm = clip({"a": torch.zeros(2)}, 1.0)
    assert norm == 0 and torch.equal(zero["a"], torch.zeros(2))


def test_noise_has_the_stated_scale_plain_and_split() -> None:
    z, c, n = 1.3, 0.5, 4
    g = torch.Generator().manual_seed(0)
    plain = add_noise({"w": torch.zeros(200_000)}, noise_std(c, z), g)["w"]
    assert float(plain.std()) == pytest.approx(z * c, rel=0.01)
    assert abs(float(plain.mean())) < 0.01
    parts = [add_noise({"w": torch.zeros(200_000)}, noise_std(c, z, shares=n), g)["w"] for _ in range(n)]
    assert float(torch.stack(parts).sum(0).std()) == pytest.approx(z * c, rel=0.01)
    half = add_noise({"h": torch.zeros(10, dtype=torch.float16)}, 0.1, g)["h"]
    assert half.dtype == torch.float16


def direct(z: float, rounds: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (1.0, 10), (4.0, 100), (10.0, 1000)])
def test_epsilon_matches_the_accountant_and_gaussian_composition(z: float, rounds: int) -> None:
    eps = Accountant(z, 1e-5).epsilon(rounds)
    assert eps == pytest.approx(direct(z, rounds, 1e-5))
    # k rounds at z are one Gaussian mechanism at z / sqrt(k)
    assert eps == pytest.approx(Accountant(z / math.sqrt(rounds), 1e-5).epsilon(1), rel=1e-6)


def test_known_value() -> None:
    # one Gaussian mechanism at z = 1, delta = 1e-5: RDP is alpha / (2 z^2); Mironov's conversion,
    # min over alpha of alpha/2 + ln(1/delta)/(alpha - 1), gives 5.30; the accountant's tighter conversion
    # gives 4.73 (dp-accounting 0.6, its default orders)
    classic = min(a / 2 + math.log(1e5) / (a - 1) for a in (1 + i / 100 for i in range(1, 5000)))
    assert classic == pytest.approx(5.2985, abs=1e-3)
    assert Accountant(1.0, 1e-5).epsilon(1) == pytest.approx(4.7285, abs=1e-3)
    assert Accountant(1.0, 1e-5).epsilon(0) == 0


@settings(max_examples=25, deadline=None)
@given(
    z=st.floats(0.3, 20),
    rounds=st.integers(1, 500),
    delta=st.floats(1e-9, 1e-3),
)
def test_epsilon_grows_with_rounds_and_shrinks_with_noise_and_delta(
    z: float, rounds: int, delta: float
) -> None:
    acc = Accountant(z, delta)
    eps = acc.epsilon(rounds)
    assert acc.epsilon(rounds + 1) >= eps
    assert Accountant(z * 1.5, delta).epsilon(rounds) <= eps
    assert Accountant(z, min(delta * 10, 0.5)).epsilon(rounds) <= eps
    allowed = acc.rounds_within(eps)
    assert allowed >= rounds and acc.epsilon(allowed + 1) > eps


def test_noise_for_a_target_keeps_every_planned_round_within_it() -> None:
    z = noise_for_target(2.0, 1e-5, 100)
    assert Accountant(z, 1e-5).epsilon(100) <= 2.0
    assert Accountant(z * 0.99, 1e-5).epsilon(100) > 2.0
    p = plan(1.0, 100, target_epsilon=2.0, delta=1e-5)
    assert p.noise_multiplier == pytest.approx(z) and p.rounds == 100


def test_the_job_stops_before_exceeding_its_target() -> None:
    p = plan(1.0, 1000, noise_multiplier=5.0, target_epsilon=3.0, delta=1e-5)
    allowed = p.rounds
    assert allowed is not None and 1 <= allowed < 1000
    p.check_round(allowed)
    with pytest.raises(Conflict, match=f"stops after round {allowed}"):
        p.check_round(allowed + 1)
    plan(1.0, 10, noise_multiplier=1.0).check_round(10_000)  # no target, no stop


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, r"clip must lie in \(0.0, inf\], not 0.0"),
        ({"clip": math.nan, "noise_multiplier": 1.0}, "clip must lie in"),
        ({"clip": 1.0, "noise_multiplier": 0.0}, r"noise_multiplier must lie in \(0.0, 100.0\], not 0.0"),
        ({"clip": 1.0, "noise_multiplier": 1e4}, "noise_multiplier must lie in"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 1.5}, r"delta must lie in \(0, 1\), not 1.5"),
        ({"clip": 1.0, "target_epsilon": -1.0, "delta": 1e-5}, "target_epsilon must lie in"),
        ({"clip": 1.0, "target_epsilon": 1.0}, "target_epsilon needs privacy.dp.delta"),
        ({"clip": 1.0}, "needs noise_multiplier, or target_epsilon and delta"),
        (
            {"clip": 1.0, "noise_multiplier": 0.5, "target_epsilon": 1.0, "delta": 1e-5},
            "one round at noise multiplier 0.5 already spends",
        ),
        ({"clip": 1.0, "target_epsilon": 1e-4, "delta": 1e-5}, "needs a noise multiplier above 100.0"),
    ],
)
def test_settings_out_of_range_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        plan(rounds=10, **kwargs)
