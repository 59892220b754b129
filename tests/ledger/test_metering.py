import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.ledger.metering import TOKENS_PER_PRICE, lease_cost_micro, token_cost_micro
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


tokens = st.integers(0, 10**12)


@given(tokens, tokens, prices, prices, tokens, tokens)
def test_token_cost_in_batches_never_exceeds_the_exact_cost_and_loses_under_a_micro_credit(
    p, c, price_in, price_out, more_p, more_c
):
    """Priced on a key's running totals, the sum of the batches is the cost of the totals: rounding
    never accumulates per request or per batch."""
    cost = token_cost_micro(p, c, price_in, price_out)
    exact = Fraction(p * price_in + c * price_out, TOKENS_PER_PRICE)
    assert cost <= exact < cost + 1
    later = token_cost_micro(p + more_p, c + more_c, price_in, price_out)
    assert later >= cost  # a later batch never pays back


def test_token_cost_examples_and_refusals():
    assert token_cost_micro(1_000_000, 0, MICRO, 0) == MICRO  # 1 credit per 1M input tokens
    assert token_cost_micro(1000, 500, 100 * MICRO, 200 * MICRO) == 200_000  # 0.1 + 0.1 credits
    assert token_cost_micro(1, 1, 999_999, 0) == 0  # under a micro-credit: floored
    for bad in ((-1, 0, 1, 1), (0, 0, 1.5, 1), (0, 0, 1, -1)):
        with pytest.raises(BadRequest, match="must be an integer >= 0"):
            token_cost_micro(*bad)
