"""A simulated network link: a ``Transport`` wrapper that meters the bytes crossing it and delays each call.

Training over the internet is limited by the node's link, not by the data centre behind it. To
measure what a job costs on, say, a 100 Mbit/s home line with 50 ms latency without leaving this
machine, each node's transport is wrapped in a ``ThrottledTransport``: every call waits as long as
the link would make it wait, and the bytes it carries are counted the way they would go on the
wire — blobs as their length, messages as their JSON::

    link = Link(bandwidth_bps=100e6, latency_s=0.05)
    transport = ThrottledTransport(inner, link)     # a call carrying n bytes takes latency + 8n / bandwidth
    ...
    transport.stats().bytes_up, transport.stats().bytes_down

Half the latency and the upload are paid before the call reaches ``inner``, the other half and
the download after, so a blob arrives no earlier than the link allows. Calls on one link do not
queue behind each other (a worker has at most one exchange in flight besides its polling, so this
is close to what a real link does). ``sleep`` is injectable, so the arithmetic is testable without
waiting. Blobs in ``preloaded`` (a node's own copy of the dataset, as DDP's
workers read theirs from disk) cost neither time nor bytes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TypeVar

from pydantic import BaseModel

from gpuflex.protocol.messages import (
    AuditStateSubmit,
    ContributionList,
    ContributionReceipt,
    ContributionSubmit,
    PeerAuditAssign,
    PeerAuditList,
    PeerAuditReport,
    RoundPublish,
    RoundState,
    SecAggList,
    SecAggPost,
    VerdictSubmit,
)
from gpuflex.train.transport import Transport

T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    """A link's speed. ``bandwidth_bps`` in bits per second, each way (None: unlimited); ``latency_s`` is
    what every call costs on top of its bytes (a request and its response: one round trip)."""

    bandwidth_bps: float | None = None
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.bandwidth_bps is None or self.bandwidth_bps > 0, f"bandwidth {self.bandwidth_bps}"
        assert self.latency_s >= 0, f"latency {self.latency_s}"

    def transfer_s(self, n_bytes: int) -> float:
        """Seconds to push ``n_bytes`` through the link, latency not included."""
        return 0.0 if self.bandwidth_bps is None else 8 * n_bytes / self.bandwidth_bps

    def delay_s(self, n_bytes: int) -> float:
        """Seconds a call carrying ``n_bytes`` (both ways together) takes on the link."""
        return self.latency_s + self.transfer_s(n_bytes)


@dataclass
class LinkStats:
    """What crossed one link: bytes each way, calls, and the seconds callers spent waiting on it."""

    bytes_up: int = 0
    bytes_down: int = 0
    calls: int = 0
    wait_s: float = 0.0

    @property
    def bytes_total(self) -> int:
        return self.bytes_up + self.bytes_down


def _json_size(reply: object) -> int:
    """The bytes a message takes on the wire: its JSON."""
    return len(reply.model_dump_json()) if isinstance(reply, BaseModel) else len(json.dumps(reply))


class ThrottledTransport:
    """``inner`` seen through ``link``: the same calls, metered and as slow as the link makes them."""

    def __init__(
        self,
        inner: Transport,
        link: Link,
        *,
        preloaded: Collection[str] = (),
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.inner = inner
        self.link = link
        self.preloaded = frozenset(preloaded)
        self._sleep = sleep
        self._stats = LinkStats()
        self._lock = threading.Lock()  # a worker calls from two threads: its loop and its exchange

    def stats(self) -> LinkStats:
        """A snapshot of what has crossed the link so far."""
        with self._lock:
            return replace(self._stats)

    def _cross(self, up: int, call: Callable[[], T], down: Callable[[T], int]) -> T:
        """Send ``up`` bytes, make the call, then receive its reply, which weighs ``down(reply)``."""
        before = self.link.latency_s / 2 + self.link.transfer_s(up)
        self._sleep(before)
        reply = call()
        received = down(reply)
        after = self.link.latency_s / 2 + self.link.transfer_s(received)
        self._sleep(after)
        with self._lock:
            self._stats.bytes_up += up
            self._stats.bytes_down += received
            self._stats.calls += 1
            self._stats.wait_s += before + after
        return reply

    def get_blob(self, digest: str) -> bytes:
        if digest in self.preloaded:
            return self.inner.get_blob(digest)
        return self._cross(len(digest), lambda: self.inner.get_blob(digest), len)

    def put_blob(self, data: bytes) -> str:
        return self._cross(len(data), lambda: self.inner.put_blob(data), len)

    def latest_round(self) -> RoundState | None:
        return self._cross(0, self.inner.latest_round, _json_size)

    def round_state(self, round: int) -> RoundState:
        return self._cross(_json_size(round), lambda: self.inner.round_state(round), _json_size)

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        return self._cross(_json_size(c), lambda: self.inner.submit_contribution(c), _json_size)

    def submit_audit_state(self, a: AuditStateSubmit) -> None:
        self._cross(_json_size(a), lambda: self.inner.submit_audit_state(a), _json_size)

    def report_verdict(self, v: VerdictSubmit) -> None:
        self._cross(_json_size(v), lambda: self.inner.report_verdict(v), _json_size)

    def assign_peer_audit(self, a: PeerAuditAssign) -> None:
        self._cross(_json_size(a), lambda: self.inner.assign_peer_audit(a), _json_size)

    def peer_audits(self, round: int | None = None) -> PeerAuditList:
        return self._cross(_json_size(round), lambda: self.inner.peer_audits(round), _json_size)

    def report_peer_audit(self, r: PeerAuditReport) -> None:
        self._cross(_json_size(r), lambda: self.inner.report_peer_audit(r), _json_size)

    def post_secagg(self, p: SecAggPost) -> None:
        self._cross(_json_size(p), lambda: self.inner.post_secagg(p), _json_size)

    def secagg_messages(self, round: int, after: int = -1) -> SecAggList:
        return self._cross(
            _json_size([round, after]), lambda: self.inner.secagg_messages(round, after), _json_size
        )

    def contributions(self, round: int) -> ContributionList:
        return self._cross(_json_size(round), lambda: self.inner.contributions(round), _json_size)

    def publish_round(self, p: RoundPublish) -> None:
        self._cross(_json_size(p), lambda: self.inner.publish_round(p), _json_size)

    def log(self, message: str) -> None:
        self._cross(_json_size(message), lambda: self.inner.log(message), _json_size)
