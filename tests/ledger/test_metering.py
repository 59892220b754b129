import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.ledger.metering import lease_cost_micro
from gpuflex.protocol.money import MICRO

seconds = st.floats(0, 10**7, allow_nan=False)
prices = st.integers(0, 1000 * MICRO)


@pytest.mark.parametrize(
    ("secs", "price", "cost"),
    [
        (3600, MICRO, MICRO),
        (3600.999, MICRO, MICRO),
        (3599.9, MICRO, 999_722),  # 3599 * 1e6 / 3600 = 999_722.2
        (1, MICRO, 277),
        (0, MICRO, 0),
        (0.99, MICRO, 0),
        (7200, 500_000, MICRO),
        (10, 1, 0),
        (3600, 0, 0),
    ],
)
def test_examples(secs, price, cost):
    assert lease_cost_micro(secs, price) == cost


@given(seconds, prices)
def test_is_floor_math(secs, price):
    exact = Fraction(math.floor(secs) * price, 3600)
    cost = lease_cost_micro(secs, price)
    assert cost <= exact < cost + 1
    assert cost <= Fraction(secs) * price / 3600  # never bills more than the exact product


@given(seconds, seconds, prices)
def test_monotone_in_seconds(a, b, price):
    lo, hi = sorted((a, b))
    assert lease_cost_micro(lo, price) <= lease_cost_micro(hi, price)


@given(seconds, prices, prices)
def test_monotone_in_price(secs, p, q):
    lo, hi = sorted((p, q))
    assert lease_cost_micro(secs, lo) <= lease_cost_micro(secs, hi)


@pytest.mark.parametrize(
    ("secs", "price"), [(-1, MICRO), (math.nan, MICRO), (math.inf, MICRO), ("1", MICRO), (1, -1), (1, 1.0)]
)
def test_rejects(secs, price):
    with pytest.raises(BadRequest):
        lease_cost_micro(secs, price)
