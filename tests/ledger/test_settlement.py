from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.ledger.accounts import PLATFORM_FEES, WORLD, consumer, escrow, provider
from gpuflex.ledger.journal import make_entry, verify_chain
from gpuflex.ledger.settlement import settle_job

C, E = consumer("c"), escrow("j")
P1, P2, P3 = provider("n1"), provider("n2"), provider("n3")


def settle(escrow_balance, costs, fee_bps=0):
    return settle_job(
        escrow_balance=escrow_balance, costs=costs, fee_bps=fee_bps, consumer_account=C, escrow_account=E
    )


def test_costs_fit_fee_and_refund():
    postings = settle(1_000_000, {P1: 300_000, P2: 100_001}, fee_bps=1000)
    assert postings == (
        (C, 599_999),
        (E, -1_000_000),
        (PLATFORM_FEES, 40_000),  # 30_000 + 10_000 (10_000.1 floored)
        (P1, 270_000),
        (P2, 90_001),
    )


def test_costs_exceed_escrow_are_scaled_by_largest_remainder():
    # exact shares of 10: 3.33.., 3.33.., 3.33.. -> 3, 3, 3 and the last unit goes to the first by name
    assert settle(10, {P1: 5, P2: 5, P3: 5}) == ((E, -10), (P1, 4), (P2, 3), (P3, 3))
    # exact shares of 10: 6.66.. and 3.33.. -> 6 + 1 (larger remainder), 3
    assert settle(10, {P1: 200, P2: 100}) == ((E, -10), (P1, 7), (P2, 3))


def test_zero_amounts_omitted():
    assert settle(500, {P1: 0, P2: 500}) == ((E, -500), (P2, 500))
    assert settle(500, {}) == ((C, 500), (E, -500))
    assert settle(0, {P1: 10}) == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"escrow_balance": -1},
        {"escrow_balance": 1.0},
        {"fee_bps": -1},
        {"fee_bps": 10_001},
        {"costs": {P1: -1}},
        {"costs": {P1: 1.5}},
        {"costs": {C: 1}},
        {"costs": {PLATFORM_FEES: 1}},
        {"costs": {"": 1}},
        {"consumer_account": E},
        {"consumer_account": ""},
    ],
)
def test_rejects(kwargs):
    args = {
        "escrow_balance": 100,
        "costs": {P1: 10},
        "fee_bps": 0,
        "consumer_account": C,
        "escrow_account": E,
    }
    with pytest.raises(BadRequest):
        settle_job(**(args | kwargs))


providers = st.sampled_from([provider(f"n{i}") for i in range(8)])


@given(
    st.integers(0, 10**13),
    st.dictionaries(providers, st.integers(0, 10**13), max_size=8),
    st.integers(0, 10_000),
)
def test_settlement_properties(escrow_balance, costs, fee_bps):
    postings = settle(escrow_balance, costs, fee_bps)
    amounts = dict(postings)
    assert len(amounts) == len(postings)
    assert list(postings) == sorted(postings)
    if escrow_balance == 0:
        assert postings == ()
        return
    assert sum(amounts.values()) == 0
    assert amounts[E] == -escrow_balance
    assert all(v > 0 for a, v in postings if a != E)
    assert sum(v for a, v in postings if a not in (E, C)) <= escrow_balance
    total = sum(costs.values())
    refund = amounts.get(C, 0)
    if total <= escrow_balance:
        assert refund == escrow_balance - total
        for account, cost in costs.items():
            assert amounts.get(account, 0) == cost - cost * fee_bps // 10_000
    else:
        assert refund == 0
        for account, cost in costs.items():
            assert amounts.get(account, 0) <= -(
                -cost * escrow_balance // total
            )  # at most its share, rounded up


@given(st.integers(1, 10**13), st.dictionaries(providers, st.integers(0, 10**13), min_size=1, max_size=8))
def test_scaled_pay_is_proportional_and_exact(escrow_balance, costs):
    total = sum(costs.values())
    amounts = dict(settle(escrow_balance, costs))
    assume(total > escrow_balance)
    assert sum(amounts.get(a, 0) for a in costs) == escrow_balance
    for account, cost in costs.items():
        share = Fraction(cost * escrow_balance, total)
        assert share - 1 < amounts.get(account, 0) < share + 1


@given(
    st.integers(1, 10**13),
    st.dictionaries(providers, st.integers(0, 10**13), max_size=8),
    st.integers(0, 10_000),
)
def test_settlement_is_a_valid_entry(escrow_balance, costs, fee_bps):
    at = "2025-01-01T00:00:00Z"
    fund = make_entry(
        None, at=at, kind="escrow", memo="", postings=[(WORLD, -escrow_balance), (E, escrow_balance)]
    )
    postings = settle(escrow_balance, costs, fee_bps)
    entry = make_entry(fund, at=at, kind="settlement", memo="", postings=postings)
    assert verify_chain([fund, entry]).ok
