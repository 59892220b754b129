"""What every route needs, made once per app: settings, the database, the blob store, the clock, the
key that signs the journal (every transaction carries it, so ``services.ledger.append`` signs) and the
heartbeat rules, cached briefly because every heartbeat needs them."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.auth.signing import NodeKey
from gpuflex.coordinator.db import READ_ONLY
from gpuflex.coordinator.services import ledger, liveness
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.storage import BlobStore


@dataclass
class CoordinatorContext:
    settings: CoordinatorSettings
    engine: Engine
    sessions: sessionmaker
    blobs: BlobStore
    clock: Callable[[], float] = field(default=time.time)
    ledger_key: NodeKey = field(init=False, repr=False)
    node_keys: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # node id -> public key
    _rules: tuple[float, liveness.Liveness] | None = field(default=None, init=False, repr=False)
    _one_writer: AbstractContextManager = field(default_factory=nullcontext, init=False, repr=False)
    _placed_at: float = field(default=-math.inf, init=False, repr=False)  # monotonic
    _placement_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.ledger_key = self.settings.resolved_ledger_key()
        if self.engine.dialect.name == "sqlite":
            # SQLite has one writer at a time (every transaction here is BEGIN IMMEDIATE): queue this
            # process's writers on a lock, not on SQLite's busy handler, which sleeps up to 100 ms a try.
            self._one_writer = threading.RLock()

    def placement_due(self) -> bool:
        """May a lease request run a placement pass now? Yes once per ``lease_placement_interval_s``."""
        with self._placement_lock:
            now = time.monotonic()
            if now - self._placed_at < self.settings.lease_placement_interval_s:
                return False
            self._placed_at = now
            return True

    def now(self) -> float:
        return self.clock()

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads: it neither waits for nor holds the write lock (on SQLite a
        deferred BEGIN, which reads a WAL snapshot beside the writer)."""
        reader = self.engine.execution_options(**{READ_ONLY: True})
        with self.sessions(bind=reader) as session, session.begin():
            yield session

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back (nothing written) on error."""
        with (
            self._one_writer,
            self.sessions(info={ledger.SIGNING_KEY: self.ledger_key}) as session,
            session.begin(),
        ):
            yield session

    def liveness(self, session: Session) -> liveness.Liveness:
        """The heartbeat rules in force, read at most once every ``liveness_cache_s``: a governed change
        or the fleet's growth shows that much later, and heartbeats skip three queries each."""
        now, cached = self.now(), self._rules
        if cached is None or not 0 <= now - cached[0] < self.settings.liveness_cache_s:
            cached = self._rules = (now, liveness.rules(session, self.settings, now))
        return cached[1]
