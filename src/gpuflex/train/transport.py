"""The runtime's one window on the network: the ``Transport`` interface, and ``LocalTransport``.

Workers and the aggregator only ever call these eight methods. The agent hands the task a
transport that speaks HTTP to the coordinator; ``LocalTransport`` keeps everything in memory
with the coordinator's semantics, for tests and for training on one machine:

- blobs are content-addressed: ``put_blob`` returns the sha256 of the bytes;
- rounds are published in order, 0, 1, 2, ...; publishing round r+1 closes round r, so a
  contribution for a closed round is refused (``submit_contribution`` returns False);
- round 0 and the last round carry a full checkpoint, every later round its aggregated update;
- the job is finished once round ``rounds`` is published.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gpuflex.errors import BadRequest, Conflict, NotFound, ServiceError
from gpuflex.protocol.messages import (
    Contribution,
    ContributionList,
    ContributionSubmit,
    RoundPublish,
    RoundState,
)
from gpuflex.train.checkpoint import sha256

if TYPE_CHECKING:
    from torch import Tensor

    from gpuflex.train.outer import GlobalReplica

Decoder = Callable[[bytes], "dict[str, Tensor]"]


class Transport(Protocol):
    """What the runtime needs from the network; the module docstring gives the semantics."""

    def get_blob(self, digest: str) -> bytes: ...

    def put_blob(self, data: bytes) -> str:
        """Store ``data``; returns its sha256 (hex)."""
        ...

    def latest_round(self) -> RoundState | None:
        """The newest published round; None before round 0 is published."""
        ...

    def round_state(self, round: int) -> RoundState:
        """A published round (its update and state hash), for catching up."""
        ...

    def submit_contribution(self, c: ContributionSubmit) -> bool:
        """True if accepted; False if round ``c.round`` is already closed (the worker is stale)."""
        ...

    def contributions(self, round: int) -> ContributionList: ...

    def publish_round(self, p: RoundPublish) -> None: ...

    def log(self, message: str) -> None: ...


@dataclass(frozen=True)
class Outgoing:
    """A round's contribution, as the wrapper hands it to an exchange."""

    blob: bytes
    tokens: int
    steps: int
    train_loss: float | None


class Exchange(Protocol):
    """How a ``DiLoCo`` replica takes part in rounds: ``RelayExchange`` over a ``Transport``, or a
    ``CollectiveTransport`` within a trusted group."""

    def join(self, replica: GlobalReplica, decode: Decoder) -> bool:
        """Bring ``replica`` to the job's newest round; False if the job is already over."""
        ...

    def exchange(self, replica: GlobalReplica, outgoing: Outgoing, decode: Decoder) -> tuple[bool, bool]:
        """Contribute to ``replica``'s round and bring it to the next round.

        Returns (whether the contribution was used, whether the job is still running)."""
        ...


def fetch_verified(transport: Transport, digest: str) -> bytes:
    """The blob ``digest``, checked against its hash: a store or a link may corrupt bytes."""
    data = transport.get_blob(digest)
    if sha256(data) != digest:
        raise ServiceError(f"blob {digest[:12]} arrived corrupted (its sha256 does not match)")
    return data


def wait_for_round(
    transport: Transport, newer_than: int, poll_interval_s: float, should_stop: Callable[[], bool]
) -> RoundState | None:
    """The latest round once it is newer than ``newer_than`` or finished; None if told to stop first."""
    while not should_stop():
        state = transport.latest_round()
        if state is not None and (state.round > newer_than or state.finished):
            return state
        time.sleep(poll_interval_s)
    return None


@dataclass
class _Hub:
    """The shared state of every ``LocalTransport`` view of one job."""

    rounds: int
    live_workers: int
    echo: Callable[[str], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    blobs: dict[str, bytes] = field(default_factory=dict)
    published: list[RoundPublish] = field(default_factory=list)
    contributions: dict[int, dict[str, Contribution]] = field(default_factory=dict)
    logs: list[tuple[str, str]] = field(default_factory=list)


class LocalTransport:
    """An in-memory, thread-safe transport for one job of ``rounds`` rounds.

    Each task talks through its own view, ``for_task(task_id)``, so contributions are
    attributed to tasks as the coordinator would; all views share one state.
    """

    def __init__(
        self,
        rounds: int,
        live_workers: int,
        *,
        task_id: str = "task-0",
        echo: Callable[[str], None] | None = None,
    ):
        self.task_id = task_id
        self._hub = _Hub(rounds=rounds, live_workers=live_workers, echo=echo)

    def for_task(self, task_id: str) -> LocalTransport:
        """A view of the same job through which task ``task_id`` acts."""
        view = copy.copy(self)
        view.task_id = task_id
        return view

    def get_blob(self, digest: str) -> bytes:
        with self._hub.lock:
            if digest not in self._hub.blobs:
                raise NotFound(f"no blob {digest}")
            return self._hub.blobs[digest]

    def put_blob(self, data: bytes) -> str:
        digest = sha256(data)
        with self._hub.lock:
            self._hub.blobs[digest] = bytes(data)
        return digest

    def latest_round(self) -> RoundState | None:
        with self._hub.lock:
            return self._latest()

    def round_state(self, round: int) -> RoundState:
        with self._hub.lock:
            if not 0 <= round < len(self._hub.published):
                raise NotFound(f"round {round} is not published")
            return self._state(self._hub.published[round])

    def submit_contribution(self, c: ContributionSubmit) -> bool:
        with self._hub.lock:
            latest = self._latest()
            if latest is None or c.round > latest.round:
                raise Conflict(f"round {c.round} has not started")
            if c.round < latest.round or latest.finished:
                return False
            if c.delta not in self._hub.blobs:
                raise BadRequest(f"contribution names blob {c.delta}, which was never uploaded")
            entry = Contribution(
                task_id=self.task_id, node_id=f"node-{self.task_id}", **c.model_dump(exclude={"round"})
            )
            self._hub.contributions.setdefault(c.round, {})[self.task_id] = entry  # a resubmission replaces
            return True

    def contributions(self, round: int) -> ContributionList:
        with self._hub.lock:
            entries = list(self._hub.contributions.get(round, {}).values())
            return ContributionList(round=round, contributions=entries, live_workers=self._hub.live_workers)

    def publish_round(self, p: RoundPublish) -> None:
        with self._hub.lock:
            expected = len(self._hub.published)
            if p.round != expected or expected > self._hub.rounds:
                raise Conflict(f"cannot publish round {p.round}: the next round is {expected}")
            for digest in (p.update, p.checkpoint):
                if digest is not None and digest not in self._hub.blobs:
                    raise BadRequest(f"round {p.round} names blob {digest}, which was never uploaded")
            if p.checkpoint is None and p.round in (0, self._hub.rounds):
                raise BadRequest(f"round {p.round} must carry the full state (checkpoint)")
            if p.update is None and p.round > 0:
                raise BadRequest(f"round {p.round} must carry its aggregated update")
            self._hub.published.append(p)

    def log(self, message: str) -> None:
        with self._hub.lock:
            self._hub.logs.append((self.task_id, message))
        if self._hub.echo is not None:
            self._hub.echo(f"[{self.task_id}] {message}")

    # -- for tests and fault injection: not part of Transport --------------------------------

    def set_live_workers(self, n: int) -> None:
        with self._hub.lock:
            self._hub.live_workers = n

    def history(self) -> list[RoundPublish]:
        """Every published round, in order."""
        with self._hub.lock:
            return list(self._hub.published)

    def logs(self) -> list[tuple[str, str]]:
        """(task_id, message) of every log line, in order."""
        with self._hub.lock:
            return list(self._hub.logs)

    def _latest(self) -> RoundState | None:
        return self._state(self._hub.published[-1]) if self._hub.published else None

    def _state(self, p: RoundPublish) -> RoundState:
        checkpoint = next(q for q in reversed(self._hub.published) if q.checkpoint is not None)
        return RoundState(
            round=p.round,
            state_hash=p.state_hash,
            update=p.update,
            checkpoint=checkpoint.checkpoint,
            checkpoint_round=checkpoint.round,
            tokens=p.tokens,
            finished=len(self._hub.published) > self._hub.rounds,
        )
