"""Parsed job specs kept per process (``coordinator.services.specs``)."""

import threading

import pytest

from gpuflex.coordinator.services.specs import SpecCache
from gpuflex.protocol.spec import JobSpec


def _raw(name: str) -> dict:
    spec = {"name": name, "resources": {"workers": 2}, "budget": 1.0, "max_price_per_hour": 0.5}
    return JobSpec.model_validate(spec).model_dump(mode="json")


def test_a_spec_is_parsed_once_and_the_kept_one_is_returned_after():
    cache = SpecCache()
    assert cache.get("j-1") is None
    first = cache.parse("j-1", _raw("first"), "training")
    assert first.name == "first" and cache.get("j-1") is first
    # a job's spec never changes: what is kept answers, whatever is passed again
    assert cache.parse("j-1", _raw("changed"), "training") is first


def test_the_least_recently_used_spec_goes_first_when_the_cache_is_full():
    cache = SpecCache(size=2)
    cache.parse("a", _raw("a"), "training")
    cache.parse("b", _raw("b"), "training")
    cache.get("a")  # used: b is now the oldest
    cache.parse("c", _raw("c"), "training")
    assert cache.get("b") is None
    assert cache.get("a").name == "a" and cache.get("c").name == "c"


def test_threads_parsing_the_same_jobs_all_get_their_specs_and_the_cache_stays_bounded():
    cache = SpecCache(size=8)
    raws = {f"j-{i}": _raw(f"n{i}") for i in range(32)}
    wrong: list[str] = []

    def parse_all() -> None:
        for job_id, raw in raws.items():
            if cache.parse(job_id, raw, "training").name != raw["name"]:
                wrong.append(job_id)

    threads = [threading.Thread(target=parse_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert sum(cache.get(job_id) is not None for job_id in raws) == 8


def test_a_cache_that_keeps_nothing_is_refused():
    with pytest.raises(ValueError, match="keeps nothing"):
        SpecCache(size=0)
