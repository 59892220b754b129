"""Calibration, pure: what completed jobs took corrects a quote's duration, and its range holds them."""

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.market import calibration
from gpuflex.market.calibration import HISTORY, MIN_JOBS, Calibration, JobTiming
from gpuflex.market.quotes import predicted_round_s, quote

from .test_pricing import _market, spec


def timing(wall_s=100.0, rounds=4, steady_round_s=20.0, predicted_round_s=10.0, time_budgeted=False):
    return JobTiming(wall_s, rounds, steady_round_s, predicted_round_s, time_budgeted)


def test_a_job_splits_into_fixed_seconds_and_rounds_at_a_speed_over_the_model():
    t = timing(wall_s=100, rounds=4, steady_round_s=20, predicted_round_s=10)
    assert t.speed == 2.0 and t.fixed_s == 20.0
    assert timing(wall_s=50, rounds=4, steady_round_s=20).fixed_s == 0.0  # never negative


def test_fewer_than_min_jobs_leave_the_prior_and_more_replace_it():
    prior = Calibration.of([timing()] * (MIN_JOBS - 1), time_budgeted=False)
    assert prior == Calibration.prior(time_budgeted=False) and prior.jobs == 0
    c = Calibration.of([timing()] * MIN_JOBS, time_budgeted=False)
    assert (c.fixed_s, c.speed, c.bias, c.spread, c.jobs) == (20.0, 2.0, 1.0, 0.0, MIN_JOBS)
    assert c.duration_s(1, rounds=10, predicted_round_s=3.0) == 20.0 + 10 * 3.0 * 2.0


def test_the_range_is_a_prediction_interval_on_the_histories_errors():
    """Jobs the medians describe within ±10%: the range is e^(t x sd x sqrt(1 + 1/n)) either way, wider
    for a short history than a long one with the same errors."""
    jobs = [timing(wall_s=w) for w in (90.0, 100.0, 110.0)]  # fixed 10, 20, 30 s: the median 20 s
    c = Calibration.of(jobs, time_budgeted=False)
    errors = [math.log(w / 100.0) for w in (90.0, 100.0, 110.0)]
    assert c.bias == pytest.approx(math.exp(statistics.fmean(errors)))
    assert c.spread == pytest.approx(statistics.stdev(errors) * 1.886 * math.sqrt(4 / 3), rel=5e-3)
    low, mid, high = (c.duration_s(end, 4, 10.0) for end in range(3))
    assert low < 90 < 110 < high and mid == pytest.approx(100.0 * c.bias)
    longer = Calibration.of(jobs * 10, time_budgeted=False)
    assert longer.spread < c.spread


def test_only_the_newest_jobs_count():
    old, new = timing(steady_round_s=50, wall_s=220), timing(steady_round_s=15, wall_s=80)
    c = Calibration.of([new] * HISTORY + [old] * 10, time_budgeted=False)
    assert c.speed == 1.5 and c.jobs == HISTORY


def test_a_time_budgeted_job_takes_the_speed_of_its_own_kind_and_the_fixed_seconds_of_all():
    budgeted = [timing(steady_round_s=11, predicted_round_s=10, time_budgeted=True)] * MIN_JOBS
    counted = [timing(wall_s=60, steady_round_s=5, predicted_round_s=10)] * MIN_JOBS
    c = Calibration.of(budgeted + counted, time_budgeted=True)
    assert c.speed == pytest.approx(1.1)
    assert c.fixed_s == 48.0  # the median over both kinds: 100 - 4 x 11 = 56, 60 - 4 x 5 = 40
    assert Calibration.of(budgeted + counted, time_budgeted=False).speed == 0.5
    # of its kind too few: the prior's speed, with the history's fixed seconds
    c = Calibration.of(counted[:1] + budgeted, time_budgeted=False)
    assert c.speed == Calibration.prior(time_budgeted=False).speed and c.jobs == MIN_JOBS + 1


def test_students_t_is_close_to_its_tables():
    for dof, table in ((2, 1.886), (4, 1.533), (10, 1.372), (1000, 1.282)):
        assert calibration._t(0.8, dof) == pytest.approx(table, rel=0.005)


# what clocks read: 0 where one did not move (a frozen test clock), else from a millisecond to a day
SECONDS = st.one_of(st.just(0.0), st.floats(1e-3, 86_400))


@given(
    st.lists(
        st.tuples(
            SECONDS,
            st.integers(0, 50),
            SECONDS,
            SECONDS,
            st.booleans(),
        ),
        max_size=60,
    ),
    st.booleans(),
    st.integers(1, 100),
    st.floats(0.01, 1000),
)
def test_the_low_end_never_exceeds_the_expected_nor_the_expected_the_high_end(
    rows, budgeted, rounds, round_s
):
    c = Calibration.of([JobTiming(*r) for r in rows], time_budgeted=budgeted)
    low, mid, high = (c.duration_s(end, rounds, round_s) for end in range(3))
    assert 0 < low <= mid <= high


def test_a_quote_on_a_calibrated_network_predicts_what_its_jobs_took():
    """Jobs that ran their rounds at 0.3x the model's time and took 30-50 s besides: the next quote says
    so, and its range holds those jobs' spread."""
    job = spec(resources={"workers": 2}, training={"rounds": 10, "inner_steps": 100})
    model_round = predicted_round_s(job.training, 0.5)  # the slowest chosen worker's ("slow", 0.5 TFLOPS)
    steady = 0.3 * 3 * model_round  # rounds thrice as long as this job's, at 0.3x their prediction
    history = [timing(fixed + 5 * steady, 5, steady, 3 * model_round) for fixed in (30.0, 40.0, 50.0)]
    q = quote(job, _market(), timings=history)
    c = Calibration.of(history, time_budgeted=False)
    assert (c.fixed_s, c.speed) == (40.0, pytest.approx(0.3))
    assert q.duration_s == pytest.approx((40.0 + 10 * model_round * 0.3) * c.bias)
    assert q.duration_low_s == pytest.approx(q.duration_s / math.exp(c.spread))
    assert q.duration_low_s < q.duration_s < q.duration_high_s
    assert q.cost == pytest.approx((0.4 + 0.1 + 0.2) * q.duration_s / 3600)
    assert any("calibrated on the network's last 3 jobs: ≈ 40 s" in a for a in q.assumptions), q.assumptions
    uncalibrated = quote(job, _market())
    assert uncalibrated.duration_s == pytest.approx(calibration.PRIOR_FIXED_S + 10 * model_round)
    assert any("not yet calibrated" in a for a in uncalibrated.assumptions)
