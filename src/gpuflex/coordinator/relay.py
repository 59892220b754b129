"""The gateway's relay to deployment replicas held by this coordinator process (``protocol.relay``).

A replica's server task long-polls for work (``poll``, on the event loop: a waiting poll holds no
thread) and posts its events back (``deliver``); the gateway hands a request to the replica of the
deployment with the fewest requests open (``submit``, from the thread pool, where the OpenAI routes run
the backend) and reads its events as a ``serve.backend.Generation``. A replica counts as connected
while it polls, and for ``STALE_S`` after its last poll ended.

This state lives in one process: a request reaches only the replicas connected to the coordinator it
reached (several coordinator replicas will share it through a broker; not yet). So do the served rates
and times to first token it keeps per deployment over the last ``WINDOW_S`` (``stats``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from gpuflex.errors import ServiceError, from_status
from gpuflex.protocol.relay import RelayCompletion, RelayEvent, RelayRequest, RelayWork
from gpuflex.serve.engine import Cancelled, Completion, Event, Usage
from gpuflex.serve.sampling import SamplingParams

STALE_S = 5.0  # a replica that has not polled for this long takes no new request
START_S = 30.0  # a replica says whether it took a request (encoded, it fits) within this
SILENCE_S = 60.0  # a request whose replica sends nothing for this long fails
WINDOW_S = 60.0  # ``stats`` covers the requests served this long ago at most


class RemoteGeneration:
    """A request being served by a replica: its events as they come, then its completion."""

    def __init__(self, deployment_id: str, params: SamplingParams, cancel: Callable[[], None], now: float):
        self.deployment_id, self.params = deployment_id, params
        self.submitted_at, self.first_token_at = now, None  # when the relay heard of them
        self.completion: Completion | None = None
        self.on_done: Callable[[Completion], None] = lambda _: None  # the gateway counts usage here
        self._events: queue.SimpleQueue[RelayEvent | None] = queue.SimpleQueue()  # None: cancelled
        self._cancel = cancel
        self._ended = False

    def put(self, event: RelayEvent) -> None:
        self._events.put(event)

    def wait_started(self) -> None:
        """Until the replica took the request; what it refused it with (a 4xx before any token)."""
        self._next(START_S, "to take the request")

    def __iter__(self) -> Iterator[Event]:
        while not self._ended:
            event = self._next(SILENCE_S, "a token")
            if event is not None:
                yield event

    def result(self) -> Completion:
        for _ in self:
            pass
        if self.completion is None:
            raise Cancelled("the request was cancelled")
        return self.completion

    def cancel(self) -> None:
        """Stop it on the replica (its client went away); a reader waiting for it gets ``Cancelled``."""
        if not self._ended:
            self._ended = True
            self._cancel()
            self._events.put(None)

    def _next(self, timeout: float, what: str) -> Event | None:
        """The next token's event; None for ``started`` and at the end (the completion kept)."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            self.cancel()
            raise ServiceError(f"the replica sent nothing for {timeout:.0f} s, waiting for {what}") from None
        if item is None:
            raise Cancelled("the request was cancelled")
        if item.kind == "error":
            self._ended = True
            raise from_status(item.status or 500, item.message)
        if item.kind == "done":
            assert item.completion is not None, "a done event carries the completion"
            self._ended = True
            self.completion = _completion(item.completion, self.params)
            self.on_done(self.completion)
            return None
        if item.kind == "token":
            assert item.token is not None, "a token event carries its token"
            return Event(item.token, item.text, item.finish_reason)
        return None


def _completion(done: RelayCompletion, params: SamplingParams) -> Completion:
    return Completion(
        prompt=tuple(done.prompt),
        tokens=tuple(done.tokens),
        text=done.text,
        finish_reason=done.finish_reason,
        params=replace(params, seed=done.seed),
        usage=Usage(done.prompt_tokens, done.completion_tokens, done.resumed_tokens),
        fingerprints=tuple(base64.b64decode(f) for f in done.fingerprints),
    )


@dataclass(frozen=True)
class Served:
    at: float
    tokens: int
    ttft_s: float


@dataclass(frozen=True)
class Stats:
    """A deployment's requests served over the last ``WINDOW_S``, as this process saw them."""

    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None


@dataclass
class _Replica:
    """One replica's line: what waits to be polled, what it serves, and how to wake its poll."""

    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    requests: list[RelayRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    open: dict[str, RemoteGeneration] = field(default_factory=dict)
    token_hash: str = ""  # its task token's, checked against the database on each poll
    polls: int = 0  # polls waiting now
    seen: float = 0.0  # when its last poll ended (monotonic)

    def connected(self, now: float) -> bool:
        return self.polls > 0 or now - self.seen < STALE_S

    def take(self) -> RelayWork:
        work = RelayWork(requests=self.requests, cancel=self.cancels)
        self.requests, self.cancels = [], []
        return work

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self.wake.set)


class Relay:
    """The replicas connected to this process, by lease id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._served: dict[str, deque[Served]] = defaultdict(deque)  # by deployment, oldest first

    async def poll(self, lease_id: str, token_hash: str, wait_s: float) -> RelayWork:
        """The work waiting for the replica of ``lease_id`` (whose task token, hashed, the caller checked),
        as soon as there is some or after ``wait_s``."""
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is None:
                replica = _Replica(asyncio.get_running_loop(), token_hash=token_hash)
                self._replicas[lease_id] = replica
            if replica.requests or replica.cancels:
                return replica.take()
            replica.wake.clear()  # on the loop, as notify's set is: no wake-up falls between
            replica.polls += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.wake.wait(), wait_s)
        finally:
            with self._lock:
                replica.polls -= 1
                replica.seen = self._clock()
        with self._lock:
            return replica.take()

    def lease_of(self, token_hash: str) -> str | None:
        """The lease of the connected replica whose task token this is (its polls checked it against the
        database): its events need no database read, one post per batch of tokens."""
        with self._lock:
            now = self._clock()
            for lease_id, replica in self._replicas.items():
                if replica.token_hash == token_hash and replica.connected(now):
                    return lease_id
        return None

    def deliver(self, lease_id: str, events: list[RelayEvent]) -> None:
        """Hand a replica's events to the requests they belong to; events of requests it does not serve
        (ended, cancelled, or never its own) are dropped."""
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is None:
                return
            now = self._clock()
            for event in events:
                generation = replica.open.get(event.id)
                if generation is None:
                    continue
                if event.kind in ("done", "error"):
                    del replica.open[event.id]
                if event.kind == "token" and generation.first_token_at is None:
                    generation.first_token_at = now
                if event.completion is not None:
                    first = generation.first_token_at or now
                    served = Served(now, event.completion.completion_tokens, first - generation.submitted_at)
                    self._served[generation.deployment_id].append(served)
                generation.put(event)

    def submit(
        self, deployment_id: str, request: RelayRequest, params: SamplingParams, leases: Collection[str]
    ) -> RemoteGeneration:
        """Hand ``request`` to the connected replica of the deployment with the fewest requests open, among
        those of live ``leases``, and wait until it took it; raises what it refused the request with."""
        with self._lock:
            now = self._clock()
            for lease_id in [k for k, r in self._replicas.items() if now - r.seen > 10 * SILENCE_S]:
                if not self._replicas[lease_id].polls:
                    del self._replicas[lease_id]  # a replica long gone
            live = [(k, r) for k, r in self._replicas.items() if k in leases and r.connected(now)]
            if not live:
                raise ServiceError(
                    f"deployment {deployment_id} has no replica serving yet: one is being placed or is "
                    "loading the model; try again shortly (`gpuflex deployment show` says where they are)"
                )
            lease_id, replica = min(live, key=lambda item: len(item[1].open))
            cancel = partial(self._cancel, lease_id, request.id)
            generation = RemoteGeneration(deployment_id, params, cancel, now)
            replica.open[request.id] = generation
            replica.requests.append(request)
            replica.notify()
        generation.wait_started()
        return generation

    def stats(self, deployment_id: str) -> Stats:
        """Requests and tokens per second served over the last ``WINDOW_S``, and the times to first token
        (from the request reaching the relay to its first token reaching it); all None with none served."""
        with self._lock:
            served = self._served.get(deployment_id)
            since = self._clock() - WINDOW_S
            while served and served[0].at < since:
                served.popleft()
            if not served:
                return Stats()
            ttft = np.array([s.ttft_s for s in served]) * 1000
            return Stats(
                requests_per_s=len(served) / WINDOW_S,
                tokens_per_s=sum(s.tokens for s in served) / WINDOW_S,
                ttft_p50_ms=float(np.percentile(ttft, 50)),
                ttft_p99_ms=float(np.percentile(ttft, 99)),
            )

    def _cancel(self, lease_id: str, request_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is not None and replica.open.pop(request_id, None) is not None:
                replica.cancels.append(request_id)
                replica.notify()
