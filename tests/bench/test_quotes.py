"""``bench/quotes.py``'s summary: the shares in range count calibrated quotes only once calibrated."""

from __future__ import annotations

from . import bench_script

quotes = bench_script("quotes")


def _row(actual, calibrated, uncalibrated, jobs_before, spent=1.0):
    return quotes.Quoted(
        job="j",
        workers=1,
        time_budgeted=False,
        actual_s=actual,
        calibrated=calibrated,
        uncalibrated=uncalibrated,
        calibrated_on=jobs_before,
        spent=spent,
        cost=(0.5, 1.0, 2.0),
        uncalibrated_cost=(0.1, 1.0, 10.0),
    )


def test_the_calibrated_share_counts_only_jobs_quoted_after_min_jobs_completed():
    wide = (1.0, 50.0, 1000.0)
    rows = [
        _row(10.0, (20.0, 30.0, 40.0), wide, 0),  # a miss, but on the prior: not a calibrated quote
        _row(10.0, (8.0, 10.0, 12.0), wide, quotes.MIN_JOBS),
        _row(15.0, (8.0, 10.0, 12.0), wide, quotes.MIN_JOBS + 1, spent=3.0),
    ]
    s = quotes.summary(rows)
    assert s["calibrated_jobs"] == 2
    assert s["in_range"] == {"calibrated": 0.5, "uncalibrated": 1.0, "uncalibrated_same_jobs": 1.0}
    assert s["cost_in_range"] == {"calibrated": 0.5, "uncalibrated_same_jobs": 1.0}
    assert s["median_error"] == {"calibrated": 0.25, "uncalibrated_same_jobs": 0.75}
    assert s["range_width"] == {"calibrated": 1.5, "uncalibrated_same_jobs": 1000.0}
    assert s["targets"] == {"in_range>=0.8": False}
