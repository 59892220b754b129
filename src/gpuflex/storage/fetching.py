"""Many blobs fetched a few at a time: a node's round trips to the store overlap (a model file's parts, a
job's shards) while memory holds a bounded number of them, and the caller still sees them in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

FETCH_WORKERS = 4  # fetches in flight at once: enough to hide a round trip, few enough for the store
K = TypeVar("K")
T = TypeVar("T")


def in_order(fetch: Callable[[K], T], keys: Iterable[K], workers: int = FETCH_WORKERS) -> Iterator[T]:
    """``fetch(key)`` for each key, yielded in the keys' order, with at most ``workers`` fetched ahead of
    the one the caller holds. A failed fetch raises where its result would come; leaving early cancels
    the fetches not yet started."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="blob-fetch")
    ahead: deque[Future[T]] = deque()
    try:
        for key in keys:
            if len(ahead) == workers:
                yield ahead.popleft().result()
            ahead.append(pool.submit(fetch, key))
        while ahead:
            yield ahead.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
