"""Scenarios are strict: what ships loads, a typo is an error naming the key."""

from __future__ import annotations

import pytest

from gpuflex.errors import SpecError
from gpuflex.sim.scenario import load_scenario, parse_scenario, shipped


@pytest.mark.parametrize("name", shipped())
def test_every_shipped_scenario_loads(name):
    scenario = load_scenario(name)
    assert scenario.name == name and scenario.jobs.templates


def test_an_unknown_key_is_an_error_that_names_it(raw_scenario):
    with pytest.raises(SpecError, match=r"availability\.crash_rate: unknown field"):
        parse_scenario(
            raw_scenario(
                availability={"session_hours_median": 1, "offline_hours_median": 1, "crash_rate": 0.1}
            )
        )
    with pytest.raises(SpecError, match=r"jobs\.templates\.0\.spec\.training\.rouns: unknown field"):
        data = raw_scenario()
        data["jobs"]["templates"][0]["spec"]["training"]["rouns"] = 3
        parse_scenario(data)


def test_bad_values_are_errors_that_say_why(tmp_path, raw_scenario):
    with pytest.raises(SpecError, match=r"core\.gpu 'H200' is not one of the gpus"):
        parse_scenario(raw_scenario(core={"share": 0.1, "gpu": "H200", "price_per_hour": 1}))
    with pytest.raises(SpecError, match="needs 0 <= low <= high"):
        parse_scenario(raw_scenario(links={"bandwidth_mbps": [500, 20], "latency_ms": [5, 80]}))
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_scenario(tmp_path / "bad.yaml")
    with pytest.raises(SpecError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.yaml")
