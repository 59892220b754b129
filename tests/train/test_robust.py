"""Robust aggregation: clipping never amplifies, the screen flags the odd ones out and no honest one."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.train.robust import fresh, median, naive_mean, robust_mean, screen

vectors = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=6, max_size=6), min_size=1, max_size=9
)


@settings(max_examples=60, deadline=None)
@given(vectors, st.lists(st.floats(1, 1e6), min_size=9, max_size=9))
def test_the_robust_mean_is_never_longer_than_the_median_input(rows, weights):
    flats = [torch.tensor(r) for r in rows]
    result = robust_mean(flats, weights[: len(flats)])
    assert float(result.norm()) <= median([float(x.norm()) for x in flats]) * (1 + 1e-5) + 1e-6


def test_a_scaled_a_flipped_and_a_zero_delta_are_screened_and_the_honest_ones_pass():
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(1000, generator=g)
    honest = [direction + 0.8 * torch.randn(1000, generator=g) for _ in range(6)]
    odd = [honest[0] * 10, -honest[1], torch.zeros(1000)]
    found = screen(honest + odd, [1.0] * 9)
    assert found[:6] == [None] * 6
    assert ["norm is over" in found[6][0], "cosine" in found[7][0], "norm is under" in found[8][0]] == [
        True
    ] * 3


def test_a_late_worker_claiming_fewer_steps_may_send_a_shorter_delta():
    g = torch.Generator().manual_seed(1)
    honest = [torch.randn(100, generator=g) + 3 for _ in range(4)]
    late = honest[0] * 0.1
    assert screen([*honest, late], [1.0] * 5)[-1] is not None  # a tenth of the norm for the whole round
    assert screen([*honest, late], [1.0] * 4 + [0.15])[-1] is None  # ... fits a sixth of the round


def test_a_younger_residual_chain_is_held_to_the_norms_of_chains_no_older():
    """A replacement node's residual has carried less mass than the others' (top-k with error feedback):
    its delta is shorter, honestly. It is judged against chains no longer than its own, if three."""
    g = torch.Generator().manual_seed(2)
    old = [torch.randn(100, generator=g) + 3 for _ in range(5)]
    joiner = old[0] * 0.35
    assert screen([*old, joiner], [1.0] * 6)[-1] is not None  # against everyone: under half the median
    assert screen([*old, joiner], [1.0] * 6, chains=[6] * 5 + [0])[-1] is None  # no peers to judge by
    joiners = [old[1] * 0.35, old[2] * 0.35, old[3] * 0.05]  # three young ones; one sent next to nothing
    found = screen([*old, *joiners], [1.0] * 8, chains=[6] * 5 + [1, 0, 1])
    assert found[5:7] == [None, None] and "norm is under" in found[7][0]
    assert found[7][1]["peers_median_norm"] < found[7][1]["median_norm"]


def test_a_fresh_residual_chain_is_not_judged_by_its_cosine_and_the_verifier_confirms_its_loss():
    """A joiner's top-k picks other coordinates than the others' carried residuals (an honest one measured
    cosine -0.014): its cosine says nothing, so the loss test judges it on every confirming batch."""
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(100, generator=g)
    old = [direction + 0.5 * torch.randn(100, generator=g) for _ in range(5)]
    noise = torch.randn(100, generator=g)
    across = noise - (noise @ direction) / (direction @ direction) * direction
    joiner = across - 0.1 * direction  # across them, and slightly against
    assert "cosine" in screen([*old, joiner], [1.0] * 6, chains=[6] * 6)[-1][0]
    assert screen([*old, joiner], [1.0] * 6, chains=[6] * 5 + [0])[-1] is None
    assert fresh([6, 6, 6, 0, 5]) == [False, False, False, True, True] and fresh([0, 0, 0]) == [False] * 3


def test_the_naive_mean_weighs_by_tokens_and_a_big_claim_buys_no_more_than_the_median():
    a, b = torch.ones(3), torch.full((3,), 4.0)
    torch.testing.assert_close(naive_mean([a, b], [3.0, 1.0]), torch.full((3,), 1.75))
    poison = torch.full((3,), 1.0)
    honest = [torch.full((3,), 1.0)] * 3
    assert float(robust_mean([*honest, poison * 1.01], [1, 1, 1, 1e9]).max()) < 1.01
