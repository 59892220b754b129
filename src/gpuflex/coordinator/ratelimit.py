"""How fast one caller may call: a token bucket per API token, per node and per task lease, and one per
client address for calls that prove nobody (sign-ups and failed authentication).

A caller's bucket is charged only once it has authenticated, so nobody can spend another's budget by
naming it. A bucket holds ``burst`` calls and refills at ``rate_per_s``; an empty one answers 429 with
``Retry-After``. The buckets live in this process's memory: behind a load balancer, N replicas let a
caller make up to N times the rate, and a restart refills every bucket.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gpuflex.errors import RateLimited


@dataclass
class _Bucket:
    tokens: float
    at: float


class TokenBuckets:
    """One bucket per key. Only the ``max_keys`` most recently used are kept: a forgotten bucket comes
    back full, which costs a caller that has been quiet nothing it had not earned back already."""

    def __init__(
        self, rate_per_s: float, burst: float, *, clock: Callable[[], float], max_keys: int = 100_000
    ):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one call of ``key``'s: 0.0 if it had one, else the seconds until it will have."""
        now = self.clock()
        with self._lock:
            bucket = self._buckets.pop(key, None) or _Bucket(self.burst, now)
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.at) * self.rate_per_s)
            bucket.at = now
            if bucket.tokens >= 1:
                bucket.tokens -= 1
                return 0.0
            return (1 - bucket.tokens) / self.rate_per_s


class RateLimits:
    """The coordinator's two kinds of bucket: authenticated callers and bare client addresses."""

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: float,
        anonymous_rate_per_s: float,
        anonymous_burst: float,
        clock: Callable[[], float],
    ):
        self.callers = TokenBuckets(rate_per_s, burst, clock=clock)
        self.addresses = TokenBuckets(anonymous_rate_per_s, anonymous_burst, clock=clock)

    def charge_caller(self, who: str) -> None:
        """One call by an authenticated ``who`` (``account:…``, ``node:…``, ``lease:…``); 429 if over."""
        _raise_if_waiting(self.callers.take(who), f"too many requests from {who}")

    def charge_address(self, address: str) -> None:
        """One call that proved nobody, from ``address``; 429 if over."""
        wait = self.addresses.take(address)
        _raise_if_waiting(wait, f"too many unauthenticated requests from {address}")


def _raise_if_waiting(wait_s: float, what: str) -> None:
    if wait_s > 0:
        raise RateLimited(f"{what}: slow down and retry in {wait_s:.1f}s", retry_after_s=wait_s)
