"""Group commit of heartbeats: the heartbeats that arrive while one batch is being written are written
together in the next, in one transaction, and each is acknowledged only once that transaction commits.

A heartbeat was its own two transactions (the nonce, then the beat): thousands of nodes made the
database's commit, and on SQLite its single write lock, the bottleneck. One writer thread per replica now
takes whatever is queued (up to ``heartbeat_batch``), writes nodes, nonces and lease renewals with one
statement each (``registry.record_beats``, ``leases.renew``) and commits once. Nothing acknowledged is
lost on a crash: a node hears back only after its beat is committed. Batches wait for nothing but the
previous commit, so a lone heartbeat is written at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Annotated

from fastapi import Depends, Request

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.services import leases, registry
from gpuflex.errors import Unauthorized
from gpuflex.protocol.messages import HeartbeatAck

log = logging.getLogger("gpuflex.coordinator")

_STOP = object()


class HeartbeatWriter:
    def __init__(self, ctx: CoordinatorContext, *, max_batch: int = 512):
        self.ctx = ctx
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="heartbeat-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def submit(self, beat: registry.Beat) -> Future:
        """Queue a heartbeat; the future holds its ``HeartbeatAck`` once committed, or the error."""
        done: Future = Future()
        self._queue.put((beat, done))
        return done

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(item)
            self._write(batch)

    def _write(self, batch: list[tuple[registry.Beat, Future]]) -> None:
        beats = [beat for beat, _ in batch]
        try:
            with self.ctx.tx() as s:
                now, rules = self.ctx.now(), self.ctx.liveness(s)
                interval_s = rules.interval_s
                refused = registry.record_beats(s, beats, interval_s=interval_s, now=now)
                held = [
                    (b.node_id, b.held if why is None else ()) for b, why in zip(beats, refused, strict=True)
                ]
                revoked = leases.renew(s, held, self.ctx.settings, rules, now)
                waiting = leases.work_waiting(s, [b.node_id for b in beats])
        except Exception as err:  # the batch is rolled back: every heartbeat in it fails alike
            log.warning("a batch of %d heartbeats failed: %s", len(batch), err)
            for _, done in batch:
                done.set_exception(err)
            return
        for (beat, done), why, stop in zip(batch, refused, revoked, strict=True):
            if isinstance(why, Unauthorized):
                done.set_exception(why)
            else:
                work = beat.node_id in waiting
                done.set_result(HeartbeatAck(heartbeat_interval_s=interval_s, revoked=stop, work=work))


async def get_heartbeats(request: Request) -> HeartbeatWriter:
    return request.app.state.heartbeats


Heartbeats = Annotated[HeartbeatWriter, Depends(get_heartbeats)]
