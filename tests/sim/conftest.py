"""A small scenario to build on: tests override what they are about."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuflex.sim.scenario import Scenario, parse_scenario


def scenario_data(**overrides) -> dict:
    job = {
        "name": "tiny",
        "resources": {"workers": 3},
        "training": {"rounds": 5, "inner_steps": 20, "model": {"n_layer": 1, "n_head": 2, "n_embd": 32}},
        "max_price_per_hour": 1.0,
        "budget": 10.0,
    }
    data = {
        "name": "tiny",
        "nodes": 200,
        "hours": 3,
        "seed": 1,
        "regions": [{"name": "eu", "share": 1}, {"name": "us", "share": 1, "utc_offset_hours": -6}],
        "gpus": [
            {"name": "RTX 3090", "share": 2, "vram_gb": 24, "tflops": 71, "price_per_hour": [0.1, 0.4]},
            {"name": "A100", "share": 1, "vram_gb": 80, "tflops": 312, "price_per_hour": [0.5, 0.9]},
        ],
        "links": {"bandwidth_mbps": [20, 500], "latency_ms": [5, 80]},
        "availability": {"session_hours_median": 1, "offline_hours_median": 1, "crash_share": 0.5},
        "core": {"share": 0.1, "gpu": "A100", "price_per_hour": 0.6},
        "jobs": {"arrivals_per_hour_per_1000_nodes": 40, "templates": [{"share": 1, "spec": job}]},
        "cloud": {"name": "cloud A100", "price_per_hour": 4.1, "tflops": 312},
        "sample_every_s": 300,
    }
    data.update(overrides)
    return data


@pytest.fixture
def make_scenario() -> Callable[..., Scenario]:
    return lambda **overrides: parse_scenario(scenario_data(**overrides))


@pytest.fixture
def raw_scenario() -> Callable[..., dict]:
    """The scenario as parsed YAML, to spoil."""
    return scenario_data
