"""What every route needs, made once per app: settings, the database, the blob store and the clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.storage import BlobStore


@dataclass
class CoordinatorContext:
    settings: CoordinatorSettings
    engine: Engine
    sessions: sessionmaker
    blobs: BlobStore
    clock: Callable[[], float] = field(default=time.time)

    def now(self) -> float:
        return self.clock()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back (nothing written) on error."""
        with self.sessions() as session, session.begin():
            yield session
