"""Reputation: the documented formula, its priors, and the weight of a failed audit."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.market.reputation import Record, reputation, score


def test_a_brand_new_node_scores_moderately_from_the_priors():
    new = reputation(Record())
    assert (new.uptime, new.completion, new.audit) == (0.9, 0.75, 1.0)
    assert score(Record()) == pytest.approx(0.675)


def test_uptime_is_the_heartbeat_ratio_smoothed_and_capped():
    # 100 of 100 expected beats: (100 + 9) / (100 + 10); half of them: (50 + 9) / 110
    assert reputation(Record(heartbeats=100, expected_heartbeats=100)).uptime == pytest.approx(109 / 110)
    assert reputation(Record(heartbeats=50, expected_heartbeats=100)).uptime == pytest.approx(59 / 110)
    # beating more often than asked can't lift uptime above a node that kept exact time
    assert reputation(Record(heartbeats=500, expected_heartbeats=100)).uptime == pytest.approx(109 / 110)
    assert reputation(Record(heartbeats=0, expected_heartbeats=10_000)).uptime < 0.001


def test_completion_counts_good_lease_ends_against_bad_ones():
    record = Record.of(
        heartbeats=0,
        present_s=0,
        heartbeat_interval_s=5,
        lease_ends={"completed": 3, "released": 1, "expired": 1, "failed": 1, "active": 7},
        audits_passed=0,
        audits_failed=0,
    )
    assert (record.good_leases, record.bad_leases) == (4, 2)  # a live lease has not ended: not counted
    assert reputation(record).completion == pytest.approx((4 + 3) / (6 + 4))


def test_expected_heartbeats_are_the_time_present_over_the_interval():
    record = Record.of(
        heartbeats=10,
        present_s=60,
        heartbeat_interval_s=2,
        lease_ends={},
        audits_passed=0,
        audits_failed=0,
    )
    assert record.expected_heartbeats == 30
    assert reputation(record).uptime == pytest.approx((10 + 9) / (30 + 10))


def test_a_failed_audit_weighs_as_ten_passed_ones():
    assert reputation(Record(audits_passed=5)).audit == 1.0  # passes alone are no news
    assert reputation(Record(audits_failed=1)).audit == pytest.approx(1 / 11)
    assert reputation(Record(audits_passed=99, audits_failed=1)).audit == pytest.approx(100 / 110)
    # a perfect long-lived node caught once falls below a new node that has done nothing yet
    veteran = Record(heartbeats=10_000, expected_heartbeats=10_000, good_leases=50, audits_passed=3)
    assert score(veteran) > 0.9
    assert score(replace(veteran, audits_failed=1)) < score(Record())


def test_evidence_moves_a_node_away_from_the_prior():
    good = Record(heartbeats=1000, expected_heartbeats=1000, good_leases=40)
    flaky = Record(heartbeats=300, expected_heartbeats=1000, good_leases=10, bad_leases=30)
    assert score(good) > score(Record()) > score(flaky)


counts = st.integers(0, 10_000)


@given(counts, st.floats(0, 1e6), counts, counts, counts, counts)
def test_the_score_is_always_in_the_unit_interval_and_never_certain(
    beats, expected, good, bad, passed, failed
):
    r = reputation(Record(beats, expected, good, bad, passed, failed))
    assert 0 < r.score < 1
    assert r.score == pytest.approx(r.uptime * r.completion * r.audit)


@given(counts, st.floats(1, 1e5), counts, counts, counts, counts)
def test_more_good_evidence_never_lowers_the_score(beats, expected, good, bad, passed, failed):
    base = Record(beats, expected, good, bad, passed, failed)
    assert score(Record(beats, expected, good + 1, bad, passed, failed)) >= score(base)
    assert score(Record(beats, expected, good, bad + 1, passed, failed)) <= score(base)
    assert score(Record(beats, expected, good, bad, passed, failed + 1)) < score(base)
