"""The inner lr over a job: warm-up, cosine decay to a tenth, or constant."""

from itertools import pairwise

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.train.schedule import FLOOR, lr_factor, lr_range, lr_share, set_lr

from .helpers import tiny_spec


def test_cosine_warms_up_peaks_then_decays_to_the_floor():
    spec = tiny_spec(lr_schedule="cosine", warmup=0.1)
    points = [i / 100 for i in range(101)]
    factors = [lr_factor(spec, p) for p in points]
    assert factors[0] < 0.05 and factors[10] == pytest.approx(1.0)
    assert all(a < b for a, b in pairwise(factors[:11]))  # warming up
    assert all(a >= b for a, b in pairwise(factors[10:]))  # decaying
    assert factors[-1] == pytest.approx(FLOOR)
    assert lr_factor(spec, 1.5) == pytest.approx(FLOOR)  # past the end (a late round) stays at the floor


def test_constant_is_the_lr_throughout():
    spec = tiny_spec(lr_schedule="constant")
    assert {lr_factor(spec, p) for p in (0.0, 0.3, 1.0)} == {1.0}


def test_set_lr_moves_every_group():
    spec = tiny_spec(lr=0.01, warmup=0.0)
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=spec.lr)
    set_lr(optimizer, spec, 0.5)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.01 * (FLOOR + (1 - FLOOR) / 2))] * 2


def test_half_a_rounds_steps_take_half_its_lr_only_where_the_lr_is_flat():
    warming = tiny_spec(rounds=60, inner_steps=8, lr_schedule="cosine", warmup=0.04)
    assert lr_share(warming, 0, 4) < 0.3  # rising lr: the later steps of round 0 move the model most
    assert lr_share(warming, 0, 8) == pytest.approx(1.0) and lr_share(warming, 0, 0) == 0.0
    flat = tiny_spec(rounds=60, inner_steps=8, lr_schedule="constant")
    assert lr_share(flat, 0, 4) == pytest.approx(0.5)


@given(
    rounds=st.integers(1, 50),
    warmup=st.floats(0.0, 0.9),
    round_=st.integers(0, 60),
    share=st.floats(0.0, 1.0),
)
def test_every_lr_of_a_round_lies_in_its_range(rounds, warmup, round_, share):
    spec = tiny_spec(rounds=rounds, lr_schedule="cosine", warmup=warmup)
    least, greatest = lr_range(spec, round_)
    assert least <= lr_factor(spec, (round_ + share) / rounds) <= greatest


def test_the_round_where_warm_up_ends_reaches_the_peak_between_its_ends():
    spec = tiny_spec(rounds=8, lr_schedule="cosine", warmup=0.04)  # round 0 spans progress 0 to 0.125
    assert lr_range(spec, 0) == (pytest.approx(0.01), pytest.approx(1.0))
    assert max(lr_factor(spec, 0.0), lr_factor(spec, 0.125)) < 0.99
