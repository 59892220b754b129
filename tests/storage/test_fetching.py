"""Blobs fetched a few at a time: in order, at most ``workers`` at once, a failure where it happened."""

from __future__ import annotations

import threading

import pytest

from gpuflex.storage.fetching import in_order


class Fetches:
    """A fetch that records how many calls run at once; the first calls meet at a barrier of ``together``,
    which breaks (failing the test) unless that many run at the same time."""

    def __init__(self, together: int = 1, fail_on: int | None = None):
        self.barrier = threading.Barrier(together, timeout=30)
        self.fail_on = fail_on
        self.calls = self.running = self.most_running = 0
        self._lock = threading.Lock()

    def __call__(self, key: int) -> int:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            self.barrier.wait()
            if key == self.fail_on:
                raise ValueError(f"no blob {key}")
            return key * 2
        finally:
            with self._lock:
                self.running -= 1


def test_blobs_are_fetched_workers_at_a_time_and_yielded_in_order():
    fetch = Fetches(together=4)
    assert list(in_order(fetch, range(12), workers=4)) == [k * 2 for k in range(12)]
    assert fetch.most_running == 4 and fetch.calls == 12


def test_a_failed_fetch_raises_where_its_blob_would_come():
    got = []
    with pytest.raises(ValueError, match="no blob 3"):
        for value in in_order(Fetches(fail_on=3), range(8), workers=2):
            got.append(value)
    assert got == [0, 2, 4]


def test_leaving_early_starts_no_more_fetches():
    fetch = Fetches()
    fetched = in_order(fetch, range(100), workers=3)
    assert next(fetched) == 0
    fetched.close()
    assert fetch.calls <= 1 + 3
