"""The governance rules: parameter ranges and the stake-weighted tally."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.ledger.governance import CHOICES, PARAMETERS, parameter, tally

weights = st.integers(min_value=1, max_value=10**12)
ballots = st.lists(st.tuples(st.sampled_from(CHOICES), weights), max_size=20)
quorums = st.sampled_from([0.01, 0.25, 0.4, 0.5, 2 / 3, 1.0])


def _total(votes, extra):
    return sum(w for _, w in votes) + extra


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("platform_fee_bps", 0, 0),
        ("platform_fee_bps", 10_000, 10_000),
        ("platform_fee_bps", 2500.0, 2500),  # a whole float is a whole number
        ("heartbeat_interval_s", 0.1, 0.1),
        ("heartbeat_interval_s", 3600, 3600.0),
        ("heartbeat_misses", 1, 1),
        ("heartbeat_misses", 100, 100),
        ("min_stake", 0, 0.0),
        ("min_stake", 1e9, 1e9),
        ("audit_rate", 0, 0.0),
        ("audit_rate", 1, 1.0),
    ],
)
def test_values_in_range_are_taken_as_the_parameters_type(name, value, expected):
    checked = parameter(name).check(value)
    assert checked == expected and type(checked) is PARAMETERS[name].type


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("platform_fee_bps", -1, "within 0..10000 bps"),
        ("platform_fee_bps", 10_001, "within 0..10000 bps"),
        ("platform_fee_bps", 12.5, "whole number"),
        ("heartbeat_interval_s", 0.09, "within 0.1..3600 s"),
        ("heartbeat_interval_s", 3600.5, "within 0.1..3600 s"),
        ("heartbeat_misses", 0, "within 1..100"),
        ("heartbeat_misses", 101, "within 1..100"),
        ("min_stake", -0.5, "within 0.. credits"),
        ("audit_rate", 1.01, "within 0..1"),
        ("audit_rate", float("nan"), "finite number"),
        ("audit_rate", float("inf"), "finite number"),
        ("audit_rate", True, "finite number"),
        ("audit_rate", "0.5", "finite number"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_parameter(name, value, problem):
    with pytest.raises(BadRequest, match=name) as err:
        parameter(name).check(value)
    assert problem in err.value.message


def test_an_unknown_parameter_lists_the_governable_ones():
    with pytest.raises(BadRequest, match="unknown parameter 'lease_ttl_s'; governable: platform_fee_bps"):
        parameter("lease_ttl_s")


def test_quorum_is_exact_and_abstain_counts_toward_it_only():
    # 40% of 10 is exactly 4 (not 4.000000000000001 as binary floats would have it)
    assert tally([("yes", 4)], total_stake=10, quorum=0.4).passed
    assert not tally([("yes", 3)], total_stake=10, quorum=0.4).passed  # below quorum
    with_abstain = tally([("yes", 3), ("abstain", 1)], total_stake=10, quorum=0.4)
    assert with_abstain.quorum_met and with_abstain.passed
    assert tally([("yes", 2), ("no", 1), ("abstain", 7)], total_stake=10, quorum=0.4).passed
    assert not tally([("abstain", 10)], total_stake=10, quorum=0.4).passed  # no side taken


def test_a_tie_fails_and_no_votes_fail():
    assert not tally([("yes", 5), ("no", 5)], total_stake=10, quorum=0.4).passed
    assert not tally([], total_stake=0, quorum=0.4).passed
    assert not tally([], total_stake=10, quorum=0.4).quorum_met


@pytest.mark.parametrize(
    ("votes", "quorum", "problem"),
    [
        ([("maybe", 1)], 0.4, "unknown vote choice"),
        ([("yes", 0)], 0.4, "more than nothing"),
        ([("yes", 1)], 0.0, "quorum"),
        ([("yes", 1)], 1.5, "quorum"),
    ],
)
def test_bad_tally_input_is_refused(votes, quorum, problem):
    with pytest.raises(ValueError, match=problem):
        tally(votes, total_stake=10, quorum=quorum)


@given(ballots, st.integers(0, 10**12), quorums)
def test_passes_exactly_when_quorum_and_strict_majority(votes, unvoted, quorum):
    t = tally(votes, total_stake=_total(votes, unvoted), quorum=quorum)
    assert t.voted == sum(w for _, w in votes)
    assert t.passed == (t.voted > 0 and t.voted >= t.quorum * t.total_stake and t.yes > t.no)


@given(ballots, st.integers(0, 10**12), quorums)
def test_below_quorum_never_passes(votes, unvoted, quorum):
    t = tally(votes, total_stake=_total(votes, unvoted), quorum=quorum)
    if t.voted < Fraction(str(quorum)) * t.total_stake:
        assert not t.quorum_met and not t.passed


@given(ballots, weights, st.integers(0, 10**12), quorums)
def test_adding_yes_stake_never_turns_a_pass_into_a_fail(votes, more, unvoted, quorum):
    total = _total(votes, unvoted) + more  # the new yes stake was there all along, unvoted
    before = tally(votes, total_stake=total, quorum=quorum)
    after = tally([*votes, ("yes", more)], total_stake=total, quorum=quorum)
    assert after.passed or not before.passed


@given(ballots, weights, st.integers(0, 10**12), quorums)
def test_adding_no_stake_never_turns_a_fail_with_quorum_into_a_pass(votes, more, unvoted, quorum):
    total = _total(votes, unvoted) + more
    before = tally(votes, total_stake=total, quorum=quorum)
    after = tally([*votes, ("no", more)], total_stake=total, quorum=quorum)
    assert before.passed or not after.passed or not before.quorum_met


def test_a_no_vote_that_completes_the_quorum_can_let_a_majority_pass():
    """The quorum paradox of any turnout quorum, kept on purpose: the turnout counts every side."""
    before = tally([("yes", 2)], total_stake=3, quorum=1.0)
    after = tally([("yes", 2), ("no", 1)], total_stake=3, quorum=1.0)
    assert not before.passed and after.passed


@given(ballots, weights, st.integers(0, 10**12), quorums)
def test_abstaining_never_changes_the_majority(votes, more, unvoted, quorum):
    total = _total(votes, unvoted) + more
    before = tally(votes, total_stake=total, quorum=quorum)
    after = tally([*votes, ("abstain", more)], total_stake=total, quorum=quorum)
    assert (after.yes > after.no) == (before.yes > before.no)
    assert after.quorum_met or not before.quorum_met


@given(st.sampled_from(sorted(PARAMETERS)), st.floats(allow_nan=False, allow_infinity=False))
def test_check_accepts_exactly_the_documented_range(name, value):
    p = PARAMETERS[name]
    fits = p.minimum <= value and (p.maximum is None or value <= p.maximum)
    fits = fits and (p.type is float or value == int(value))
    if fits:
        assert p.check(value) == value
    else:
        with pytest.raises(BadRequest, match=name):
            p.check(value)
