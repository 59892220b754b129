"""The gateway's relay to deployment replicas held by this coordinator process (``protocol.relay``).

A replica's server task long-polls for work (``poll``, on the event loop: a waiting poll holds no
thread) and posts its events back (``deliver``); the gateway hands a request to the replica of the
deployment with the fewest requests open (``submit``, from the thread pool, where the OpenAI routes run
the backend) and reads its events as a ``serve.backend.Generation``. A replica counts as connected
while it polls, and for ``STALE_S`` after its last poll ended.

This state lives in one process: with several coordinator processes, a request for a deployment none
of whose replicas poll this one goes through the broker (``coordinator.broker``) to the process that holds
one, and fails over from there as from a replica of its own. The served rates and times to first token
kept per deployment over the last ``WINDOW_S`` (``stats``) are this process's.
"""

from __future__ import annotations

import asyncio
import base64
import queue
import secrets
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from gpuflex.errors import ServiceError, from_status
from gpuflex.protocol.messages import DeploymentInfo
from gpuflex.protocol.relay import RelayCompletion, RelayEvent, RelayRequest, RelayWork
from gpuflex.serve.engine import Cancelled, Completion, Event, Usage
from gpuflex.serve.sampling import SamplingParams

Info = TypeVar("Info", bound=DeploymentInfo)

if TYPE_CHECKING:
    from gpuflex.coordinator.broker import Broker

STALE_S = 5.0  # a replica that has not polled for this long takes no new request
LOST_S = 3.0  # a replica with no poll waiting for this long is lost: its requests move to another
CHECK_S = 0.5  # how often a request waiting for its replica's events checks the replica is there
MAX_FAILOVERS = 3  # a request that lost its replica this many times fails
REMOTE = "@"  # prefixes a request's lease id: another coordinator process (its broker channel) serves it
START_S = 30.0  # a replica says whether it took a request (encoded, it fits) within this
SILENCE_S = 60.0  # a request whose replica sends nothing for this long fails
WINDOW_S = 60.0  # ``stats`` covers the requests served this long ago at most


class RemoteGeneration:
    """A request being served by a replica: its events as they come, then its completion.

    When its replica is lost (``Relay`` says so: its poll's connection dropped, or no poll for
    ``LOST_S``), the request moves to another live replica of the deployment with the output tokens read
    so far as ``resume`` (same seed): the reader sees one uninterrupted stream, exactly the tokens an
    uninterrupted run gives, and one completion that counts every output token once."""

    def __init__(
        self,
        relay: Relay,
        deployment_id: str,
        request: RelayRequest,
        params: SamplingParams,
        leases: Collection[str],
        now: float,
    ):
        self.deployment_id, self.request, self.params = deployment_id, request, params
        self.leases = frozenset(leases)
        self.lease_id = ""  # the replica serving it now (``Relay._place``)
        self.lost: set[str] = set()  # replicas it was lost on (the broker adds those lost elsewhere)
        self.moves = 0  # how many times it moved on
        self.submitted_at, self.first_token_at = now, None  # when the relay heard of them
        self.completion: Completion | None = None
        self.on_done: Callable[[Completion], None] = lambda _: None  # the gateway counts usage here
        self._relay = relay
        self._events: queue.SimpleQueue[RelayEvent | tuple[str, str] | None] = queue.SimpleQueue()
        self._tokens: list[int] = []  # the output tokens read so far
        self._finished = False  # the last one read ended the output
        self._skip = 0  # token events of this replica that repeat ones read from a lost replica
        self._ended = False

    def put(self, event: RelayEvent | tuple[str, str]) -> None:
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
            self._relay._cancel(self.lease_id, self.request.id)
            self._events.put(None)

    def _next(self, timeout: float, what: str) -> Event | None:
        """The next token's event; None for ``started`` and at the end (the completion kept)."""
        waited = 0.0
        while True:
            try:
                item = self._events.get(timeout=CHECK_S)
            except queue.Empty:
                waited += CHECK_S
                if not self._relay.alive(self.lease_id):
                    self._failover()
                    waited = 0.0
                elif waited >= timeout:
                    self.cancel()
                    raise ServiceError(
                        f"the replica sent nothing for {timeout:.0f} s, waiting for {what}"
                    ) from None
                continue
            if item is None:
                raise Cancelled("the request was cancelled")
            if isinstance(item, tuple):  # ("lost", request id): its replica is gone
                if item[1] == self.request.id:
                    self._failover()
                    waited = 0.0
                continue
            return self._read(item)

    def _read(self, item: RelayEvent) -> Event | None:
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
            if self._skip:  # drawn again after a lost replica's last token: read already
                self._skip -= 1
                return None
            self._tokens.append(item.token)
            self._finished = item.finish_reason is not None
            return Event(item.token, item.text, item.finish_reason)
        return None

    def _failover(self) -> None:
        """Go on on another live replica from the tokens read (the last one drawn again if it ended the
        output: a resumed output must not have ended); ``ServiceError`` when none is left."""
        if not self.lease_id.startswith(REMOTE):  # a remote one: the broker names the replica lost
            self.lost.add(self.lease_id)
        self.moves += 1
        if self.moves > MAX_FAILOVERS:
            self._ended = True
            raise ServiceError(f"the request lost its replica {self.moves} times: giving up")
        resume = self._tokens[:-1] if self._finished else list(self._tokens)
        self._skip = len(self._tokens) - len(resume)
        self.request = self.request.model_copy(update={"id": secrets.token_hex(12), "resume": resume})
        try:
            self._relay._place(self)
        except ServiceError:
            self._ended = True
            raise


def _completion(done: RelayCompletion, params: SamplingParams) -> Completion:
    """The client's completion: its output tokens are all counted, the resumed ones too (a lost replica
    drew them, and nobody billed them: it never ended the request)."""
    return Completion(
        prompt=tuple(done.prompt),
        tokens=tuple(done.tokens),
        text=done.text,
        finish_reason=done.finish_reason,
        params=replace(params, seed=done.seed),
        usage=Usage(done.prompt_tokens, done.completion_tokens + done.resumed_tokens, done.resumed_tokens),
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
    lost: bool = False  # its requests moved on (``Relay._lose``) and it has not polled since

    def connected(self, now: float) -> bool:
        return self.polls > 0 or (not self.lost and now - self.seen < STALE_S)

    def take(self) -> RelayWork:
        work = RelayWork(requests=self.requests, cancel=self.cancels)
        self.requests, self.cancels = [], []
        return work

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self.wake.set)


class Relay:
    """The replicas connected to this process, by lease id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.broker: Broker | None = None  # with other coordinator processes (``coordinator.broker``)
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._served: dict[str, deque[Served]] = defaultdict(deque)  # by deployment, oldest first

    async def poll(
        self, lease_id: str, token_hash: str, wait_s: float, gone: Awaitable[None] | None = None
    ) -> RelayWork:
        """The work waiting for the replica of ``lease_id`` (whose task token, hashed, the caller checked),
        as soon as there is some or after ``wait_s``. ``gone`` ends when the poll's connection drops:
        the replica is lost (killed, or its machine gone), and its requests move to another at once."""
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is None:
                replica = _Replica(asyncio.get_running_loop(), token_hash=token_hash)
                self._replicas[lease_id] = replica
            replica.lost = False
            if self.broker is not None:
                self.broker.announce(lease_id)
            if replica.requests or replica.cancels:
                return replica.take()
            replica.wake.clear()  # on the loop, as notify's set is: no wake-up falls between
            replica.polls += 1
        woken = asyncio.ensure_future(replica.wake.wait())
        dropped = asyncio.ensure_future(gone if gone is not None else asyncio.Event().wait())
        try:
            await asyncio.wait({woken, dropped}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            dropped.cancel()
            with self._lock:
                replica.polls -= 1
                replica.seen = self._clock()
        with self._lock:
            if dropped.done() and not dropped.cancelled():
                if not replica.polls:
                    self._lose(replica)
                return RelayWork()
            return replica.take()

    def alive(self, lease_id: str) -> bool:
        """Whether the replica of ``lease_id`` still serves; one with no poll waiting for ``LOST_S`` is
        lost (``_lose``), and so is one this process no longer knows."""
        if lease_id.startswith(REMOTE):  # its holder says when it is lost; and it is, if the holder died
            assert self.broker is not None, "only the broker's requests are remote"
            return self.broker.alive(lease_id.removeprefix(REMOTE))
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is None or replica.lost:
                return False
            if replica.polls == 0 and self._clock() - replica.seen > LOST_S:
                self._lose(replica)
                return False
            return True

    def _lose(self, replica: _Replica) -> None:
        """(Under the lock.) Its requests move to other replicas (each reader is told), and are cancelled
        on it, should it poll again."""
        replica.lost = True
        queued = {r.id for r in replica.requests}  # not taken by it yet
        replica.requests = []
        for request_id, generation in replica.open.items():
            generation.put(("lost", request_id))
            if request_id not in queued:
                replica.cancels.append(request_id)
        replica.open.clear()

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
        generation = RemoteGeneration(self, deployment_id, request, params, leases, self._clock())
        self._place(generation)
        generation.wait_started()
        return generation

    def _place(self, generation: RemoteGeneration, *, brokered: bool = True) -> None:
        """Queue the generation's request on the live replica with the fewest requests open, among its
        leases' and not one it was lost on, else (``brokered``) send it to another process holding one;
        ``ServiceError`` when there is none."""
        with self._lock:
            now = self._clock()
            for lease_id in [k for k, r in self._replicas.items() if now - r.seen > 10 * SILENCE_S]:
                if not self._replicas[lease_id].polls:
                    del self._replicas[lease_id]  # a replica long gone
            live = [
                (k, r)
                for k, r in self._replicas.items()
                if k in generation.leases and k not in generation.lost and r.connected(now)
            ]
            if not live and brokered and self.broker is not None:
                holder = self.broker.holder(generation.leases - generation.lost)
                if holder is not None:  # another coordinator process holds its replicas
                    generation.lease_id = REMOTE + holder
                    self.broker.submit(generation, holder)
                    return
            if not live:
                lost = " any more (its replica was lost)" if generation.lost else " yet"
                raise ServiceError(
                    f"deployment {generation.deployment_id} has no replica serving{lost}: one is being "
                    "placed or is loading the model; try again shortly (`gpuflex deployment show` says "
                    "where they are)"
                )
            lease_id, replica = min(live, key=lambda item: len(item[1].open))
            generation.lease_id = lease_id
            replica.open[generation.request.id] = generation
            replica.requests.append(generation.request)
            replica.notify()

    def measured(self, info: Info) -> Info:
        """``info`` with what this process served of the deployment over the last ``WINDOW_S``."""
        return info.model_copy(update=asdict(self.stats(info.id)))

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
        if lease_id.startswith(REMOTE):
            assert self.broker is not None, "only the broker's requests are remote"
            self.broker.cancel(lease_id.removeprefix(REMOTE), request_id)
            return
        with self._lock:
            replica = self._replicas.get(lease_id)
            if replica is not None and replica.open.pop(request_id, None) is not None:
                replica.cancels.append(request_id)
                replica.notify()
