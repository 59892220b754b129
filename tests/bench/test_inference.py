"""``bench/inference.py``'s arithmetic: percentiles, rates, and the verifier's cost ratio over groups."""

from __future__ import annotations

import pytest

from . import bench_script


@pytest.fixture(scope="module")
def inference():
    return bench_script("inference")


def test_percentiles_interpolate_between_ranks(inference):
    values = [40.0, 10.0, 30.0, 20.0]  # unordered: sorted first
    assert inference.percentile(values, 0) == 10.0
    assert inference.percentile(values, 100) == 40.0
    assert inference.percentile(values, 50) == pytest.approx(25.0)
    assert inference.percentile(values, 99) == pytest.approx(39.7)
    assert inference.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        inference.percentile([], 50)
    with pytest.raises(ValueError):
        inference.percentile(values, 101)


def test_a_rate_of_nothing_is_none_and_a_rate_is_hits_over_total(inference):
    assert inference.rate(0, 300) == 0.0
    assert inference.rate(3, 4) == 0.75
    assert inference.rate(0, 0) is None
    with pytest.raises(ValueError):
        inference.rate(5, 4)


def test_the_cost_ratio_compares_groups_the_provider_served_on_as_many_threads(inference):
    key = f"verify_s_{inference.COST_THREADS}_thread"
    groups = [
        {"prover_threads": inference.COST_THREADS, "max_batch": 1, "generate_s": 10.0, key: 1.0},
        {"prover_threads": inference.COST_THREADS, "max_batch": 8, "generate_s": 2.0, key: 1.0},
        {"prover_threads": inference.COST_THREADS + 1, "max_batch": 8, "generate_s": 1.0, key: 5.0},
    ]
    overall, by_batch = inference.cost_ratios(groups)
    assert overall == pytest.approx(2.0 / 12.0)  # the third group, on other threads, is left out
    assert by_batch == {"1": 0.1, "8": 0.5}
