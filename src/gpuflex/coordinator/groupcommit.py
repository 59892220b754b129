"""Group commit of the calls every node makes often: heartbeats and lease requests.

Each was its own two transactions (the nonce, then the work): thousands of nodes made the database's
commit — a disk flush each on PostgreSQL, and on SQLite its single write lock — the bottleneck (py-spy:
three quarters of a lease request's time went to waiting on the database). One writer thread per kind
per replica now takes whatever is queued (up to ``max_batch``), writes it with one statement per kind of
row and commits once. Nothing acknowledged is lost on a crash: a caller hears back only after its call
is committed. A lone call is written at once. Under load a batch waits, at most ``linger_s`` (5 ms), for
as many calls as the batch before: its callers ask again as soon as they hear back, and a batch costs
about the same whatever its size. Without the wait, 1,000 nodes asking for leases over 32 connections
(PostgreSQL) were granted in batches of 26 and 6 by turns (15.4 on average), each costing a whole batch;
with it, 25 on average, and 5% to 57% more grants per second in seven interleaved pairs of runs.

A call may come with a check to pass before it is written (the fast path's signature check). Checks run
on their own threads, while the writer writes the batch before: an Ed25519 verification is about 0.1 ms
and releases the GIL, so they run beside both the event loop and the writer. Run by the writer, checking
a batch took twice as long as writing it (the verifications waited on the GIL one by one), and the
writer was the bottleneck.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Annotated, Generic, TypeVar

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.services import leases, registry
from gpuflex.errors import Unauthorized
from gpuflex.protocol.messages import HeartbeatAck, LeaseGrant

log = logging.getLogger("gpuflex.coordinator")

_STOP = object()
Call = TypeVar("Call", bound=registry.Call)
Answer = TypeVar("Answer")


class GroupCommit(Generic[Call, Answer]):
    """A queue of signed node calls and the thread that writes them in batches (``write``, per kind),
    after ``checkers`` threads have checked those that came with a check."""

    name = "group-commit"

    def __init__(
        self,
        ctx: CoordinatorContext,
        metrics: CoordinatorMetrics,
        *,
        max_batch: int = 512,
        checkers: int = 2,
        linger_s: float = 0.005,
    ):
        self.ctx = ctx
        self.metrics = metrics
        self.max_batch = max_batch
        self.linger_s = linger_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._checking: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        checker = f"{self.name}-check"
        self._checkers = [
            threading.Thread(target=self._check, name=checker, daemon=True) for _ in range(checkers)
        ]

    def start(self) -> None:
        self._thread.start()
        for checker in self._checkers:
            checker.start()

    def stop(self) -> None:
        """Stop once everything queued is written: checkers first, so what they pass is written too."""
        for _ in self._checkers:
            self._checking.put(_STOP)
        for checker in self._checkers:
            checker.join(timeout=10)
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def submit(self, call: Call, check: Callable[[], None] | None = None) -> Future:
        """Queue a call; the future holds its answer once committed, or why it was refused. ``check``,
        if given, must pass first: whatever it raises refuses the call."""
        done: Future = Future()
        if check is None:
            self._queue.put((call, done))
        else:
            self._checking.put((call, check, done))
        return done

    def write(self, session: Session, calls: list[Call]) -> list[Answer | Unauthorized]:
        """Each call's answer, in order, or why it alone is refused; all in the caller's transaction."""
        raise NotImplementedError

    def answered(self, call: Call, answer: Answer) -> None:
        """Count and log a call once its answer is committed."""
        raise NotImplementedError

    def _run(self) -> None:
        last = 0  # the size of the batch before
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            # Up to as many as the batch before, waiting at most ``linger_s``: the callers it answered ask
            # again at once, and a batch costs about the same whatever its size. A lone call waits for none.
            until = time.monotonic() + self.linger_s
            while len(batch) < self.max_batch:
                wait = until - time.monotonic() if len(batch) < last else 0
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(item)
            last = len(batch)
            self._commit(batch)

    def _check(self) -> None:
        while (item := self._checking.get()) is not _STOP:
            call, check, done = item
            try:
                check()
            except Exception as err:
                done.set_exception(err)
                continue
            self._queue.put((call, done))

    def _commit(self, batch: list[tuple[Call, Future]]) -> None:
        try:
            with self.ctx.tx() as s:
                answers = self.write(s, [call for call, _ in batch])
        except Exception as err:  # the batch is rolled back: every call in it fails alike
            log.warning("a batch of %d %s calls failed: %s", len(batch), self.name, err)
            for _, done in batch:
                done.set_exception(err)
            return
        for (call, done), answer in zip(batch, answers, strict=True):
            if isinstance(answer, Unauthorized):
                done.set_exception(answer)
                continue
            done.set_result(answer)  # committed: whatever counting it does, the caller hears back
            try:
                self.answered(call, answer)
            except Exception:
                log.exception("counting an answered %s call failed", self.name)


class HeartbeatWriter(GroupCommit[registry.Beat, HeartbeatAck]):
    """Heartbeats: nonces, node rows and lease renewals (``registry.record_beats``, ``leases.renew``)."""

    name = "heartbeat-writer"

    def write(self, session: Session, calls: list[registry.Beat]) -> list[HeartbeatAck | Unauthorized]:
        now, rules = self.ctx.now(), self.ctx.liveness(session)
        interval_s = rules.interval_s
        refused = registry.record_beats(session, calls, interval_s=interval_s, now=now)
        held = [(b.node_id, b.held if why is None else ()) for b, why in zip(calls, refused, strict=True)]
        revoked = leases.renew(session, held, self.ctx.settings, rules, now)
        waiting = leases.work_waiting(session, [b.node_id for b in calls])
        return [
            why or HeartbeatAck(heartbeat_interval_s=interval_s, revoked=stop, work=b.node_id in waiting)
            for b, why, stop in zip(calls, refused, revoked, strict=True)
        ]

    def answered(self, call: registry.Beat, answer: HeartbeatAck) -> None:
        self.metrics.heartbeats.inc()


class LeaseGranter(GroupCommit[registry.Call, LeaseGrant | None]):
    """Lease requests: nonces, then each node's next placed task claimed (``leases.grant``); None
    answers a node with nothing placed on it, or one already holding a lease."""

    name = "lease-granter"

    def write(self, session: Session, calls: list[registry.Call]) -> list[LeaseGrant | Unauthorized | None]:
        now = self.ctx.now()
        nodes = registry.nodes(session, [c.node_id for c in calls], leases.GRANT_READS)
        refused = registry.admit(session, calls, {n.id: n.state for n in nodes.values()}, now)
        asking = [nodes[c.node_id] for c, why in zip(calls, refused, strict=True) if why is None]
        rules, may_place = self.ctx.liveness(session), self.ctx.placement_due
        grants = iter(leases.grant(session, asking, self.ctx.settings, rules, now, may_place=may_place))
        return [why or next(grants) for why in refused]

    def answered(self, call: registry.Call, answer: LeaseGrant | None) -> None:
        if answer is not None:
            self.metrics.leases_granted.inc()
            ids = {"job_id": answer.job_id, "node_id": call.node_id, "lease_id": answer.lease_id}
            log.info("lease granted", extra={**ids, "role": answer.role})


async def get_heartbeats(request: Request) -> HeartbeatWriter:
    return request.app.state.heartbeats


async def get_lease_granter(request: Request) -> LeaseGranter:
    return request.app.state.lease_granter


Heartbeats = Annotated[HeartbeatWriter, Depends(get_heartbeats)]
Grants = Annotated[LeaseGranter, Depends(get_lease_granter)]
