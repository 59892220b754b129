"""The runtime's one window on the network: the ``Transport`` interface, and ``LocalTransport``.

Workers and the aggregator only ever call these fifteen methods. The agent hands the task a
transport that speaks HTTP to the coordinator; ``LocalTransport`` keeps everything in memory
with the coordinator's semantics, for tests and for training on one machine:

- blobs are content-addressed: ``put_blob`` returns the sha256 of the bytes;
- rounds are published in order, 0, 1, 2, ...; publishing round r+1 closes round r, so a
  contribution for a closed round is refused (its receipt says ``accepted=False``);
- round 0 and the last round carry a full checkpoint, every later round its aggregated update;
- the job is finished once round ``rounds`` is published;
- a contribution with a commitment is drawn for audit with probability ``audit_rate``, the segment
  uniform over its trace (the receipt's ``audit_segment``); only a drawn contribution may get an
  audit state (``submit_audit_state``), for that segment;
- the aggregator may hand a drawn contribution to another task to re-run (``assign_peer_audit``,
  once per contribution); that task alone sees the order until it reports (``report_peer_audit``),
  and the aggregator sees every order with the hashes reported;
- secure aggregation's messages (``post_secagg``, ``secagg_messages``) follow ``privacy.mailbox``'s
  rules: the aggregator reads them all, a worker those to everyone and to itself;
- a guilty verdict (``report_verdict``) discards the contribution and excludes its task from the job:
  its later submissions raise ``Conflict``, as the coordinator's 409 for an ended lease.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gpuflex.errors import BadRequest, Conflict, NotFound, ServiceError
from gpuflex.privacy import mailbox
from gpuflex.privacy.envelope import JOB_BLOB, decrypt_blob, encrypt_blob
from gpuflex.protocol.messages import (
    AuditStateSubmit,
    Contribution,
    ContributionList,
    ContributionReceipt,
    ContributionSubmit,
    PeerAudit,
    PeerAuditAssign,
    PeerAuditList,
    PeerAuditReport,
    RoundPublish,
    RoundState,
    SecAggList,
    SecAggMessage,
    SecAggPost,
    Verdict,
    VerdictSubmit,
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

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        """Accepted unless round ``c.round`` is already closed (the worker is stale); it may be drawn
        for audit. Raises ``Conflict`` once the task no longer holds its lease (excluded)."""
        ...

    def submit_audit_state(self, a: AuditStateSubmit) -> None:
        """A drawn contribution's answer: its ``commitment.AuditState`` blob for segment ``a.segment``."""
        ...

    def report_verdict(self, v: VerdictSubmit) -> None:
        """The aggregator's finding on one contribution (every guilty one, every finished audit)."""
        ...

    def assign_peer_audit(self, a: PeerAuditAssign) -> None:
        """The aggregator hands a drawn contribution's segments to another worker to re-run."""
        ...

    def peer_audits(self, round: int | None = None) -> PeerAuditList:
        """The aggregator's: every order of ``round``, with the peers' hashes; a worker's: the orders
        its task has still to report."""
        ...

    def report_peer_audit(self, r: PeerAuditReport) -> None:
        """A peer's hashes of an order it was handed."""
        ...

    def post_secagg(self, p: SecAggPost) -> None:
        """A secure-aggregation message of this task (``train.secure``); a retry of one stored is a no-op."""
        ...

    def secagg_messages(self, round: int, after: int = -1) -> SecAggList:
        """The secure-aggregation messages of ``round`` this task may read, in the order posted: those
        after ``seq`` ``after``."""
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


class SealedTransport:
    """``privacy.encrypt``: ``inner`` with every blob sealed under the job's data key on the way out and
    opened on the way in, so the coordinator's store holds only ciphertext. A blob's digest is its
    ciphertext's; AES-GCM's tag is what checks a blob opened here."""

    def __init__(self, inner: Transport, data_key: bytes):
        self._inner, self._key = inner, data_key

    def get_blob(self, digest: str) -> bytes:
        return self.unseal(self.get_stored(digest))

    def get_stored(self, digest: str) -> bytes:
        """A blob of the job as the store holds it: ciphertext, what a node caches."""
        return self._inner.get_blob(digest)

    def unseal(self, blob: bytes) -> bytes:
        """A blob of the job opened (a prepared dataset's shards are fetched through the shard cache)."""
        return decrypt_blob(self._key, blob, JOB_BLOB)

    def put_blob(self, data: bytes) -> str:
        return self._inner.put_blob(encrypt_blob(self._key, data, JOB_BLOB))

    def __getattr__(self, name: str):  # every other call goes through as it is
        return getattr(self._inner, name)


def as_stored(transport: Transport) -> tuple[Callable[[str], bytes], Callable[[bytes], bytes] | None]:
    """How a task fetches the job's blobs as the store holds them (what its node caches), and what opens
    them: an encrypted job's ``SealedTransport``'s key; None for plaintext."""
    if isinstance(transport, SealedTransport):
        return transport.get_stored, transport.unseal
    return transport.get_blob, None


def fetch_verified(transport: Transport, digest: str) -> bytes:
    """The blob ``digest``, checked against its hash (a store or a link may corrupt bytes), or opened
    and so checked by its tag."""
    data = transport.get_blob(digest)
    if not isinstance(transport, SealedTransport) and sha256(data) != digest:
        raise ServiceError(f"blob {digest[:12]} arrived corrupted (its sha256 does not match)")
    return data


def wait_for_round(
    transport: Transport,
    newer_than: int,
    poll_interval_s: float,
    should_stop: Callable[[], bool],
    idle: Callable[[], None] | None = None,
) -> RoundState | None:
    """The latest round once it is newer than ``newer_than`` or finished; None if told to stop first.
    ``idle`` runs between polls (a peer's audits)."""
    while not should_stop():
        state = transport.latest_round()
        if state is not None and (state.round > newer_than or state.finished):
            return state
        if idle is not None:
            idle()
        time.sleep(poll_interval_s)
    return None


@dataclass
class _Hub:
    """The shared state of every ``LocalTransport`` view of one job."""

    rounds: int
    live_workers: int
    echo: Callable[[str], None] | None
    audit_rate: float
    draw: random.Random  # the audit draw: seeded, so a test run is reproducible
    lock: threading.Lock = field(default_factory=threading.Lock)
    blobs: dict[str, bytes] = field(default_factory=dict)
    published: list[RoundPublish] = field(default_factory=list)
    contributions: dict[int, dict[str, Contribution]] = field(default_factory=dict)
    logs: list[tuple[str, str]] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    excluded: set[str] = field(default_factory=set)  # tasks a guilty verdict ended
    peer_audits: dict[tuple[int, str], PeerAudit] = field(default_factory=dict)  # by (round, audited task)
    assigner: str | None = None  # the task that hands out peer audits: the aggregator
    secagg: dict[int, list[SecAggMessage]] = field(default_factory=dict)  # by round
    aggregator: str | None = None  # the task that posts secure aggregation's rosters


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
        audit_rate: float = 0.0,
        audit_seed: int = 0,
    ):
        self.task_id = task_id
        self._hub = _Hub(rounds, live_workers, echo, audit_rate, random.Random(audit_seed))

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

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        with self._hub.lock:
            if self.task_id in self._hub.excluded:
                raise Conflict(f"task {self.task_id} was excluded from the job by a guilty verdict")
            latest = self._latest()
            if latest is None or c.round > latest.round:
                raise Conflict(f"round {c.round} has not started")
            if c.round < latest.round or latest.finished:
                return ContributionReceipt(accepted=False)
            if c.delta not in self._hub.blobs:
                raise BadRequest(f"contribution names blob {c.delta}, which was never uploaded")
            segment = None
            if c.commitment is not None and self._hub.draw.random() < self._hub.audit_rate:
                segment = self._hub.draw.randrange(len(c.commitment.trace))
            entry = Contribution(
                task_id=self.task_id,
                node_id=self._node(self.task_id),
                audit_segment=segment,
                **self._carried(c.round),
                **c.model_dump(exclude={"round"}),
            )
            self._hub.contributions.setdefault(c.round, {})[self.task_id] = entry  # a resubmission replaces
            return ContributionReceipt(accepted=True, audit_segment=segment)

    def _carried(self, round: int) -> dict[str, str | int | None]:
        """What this task's latest contribution before ``round`` left (as ``rounds._carried``)."""
        for earlier in sorted((r for r in self._hub.contributions if r < round), reverse=True):
            entry = self._hub.contributions[earlier].get(self.task_id)
            if entry is not None and entry.commitment is not None:
                return {"carried": entry.commitment.residual_out, "carried_chain": entry.commitment.chain}
            if entry is not None:
                break
        return {}

    def submit_audit_state(self, a: AuditStateSubmit) -> None:
        with self._hub.lock:
            entry = self._hub.contributions.get(a.round, {}).get(self.task_id)
            if entry is None or entry.audit_segment != a.segment:
                raise Conflict(
                    f"round {a.round}: no contribution of {self.task_id} drawn at segment {a.segment}"
                )
            if a.state not in self._hub.blobs:
                raise BadRequest(f"audit state names blob {a.state}, which was never uploaded")
            self._hub.contributions[a.round][self.task_id] = entry.model_copy(update={"audit_state": a.state})

    def report_verdict(self, v: VerdictSubmit) -> None:
        with self._hub.lock:
            self._hub.verdicts.insert(
                0, Verdict(node_id=self._node(v.task_id), at=time.time(), **v.model_dump())
            )
            if v.guilty:
                self._hub.contributions.get(v.round, {}).pop(v.task_id, None)
                if v.task_id not in self._hub.excluded:
                    self._hub.excluded.add(v.task_id)
                    self._hub.live_workers = max(0, self._hub.live_workers - 1)  # nobody re-leases it here

    def assign_peer_audit(self, a: PeerAuditAssign) -> None:
        with self._hub.lock:
            entry = self._hub.contributions.get(a.round, {}).get(a.task_id)
            if entry is None or entry.audit_segment is None:
                raise Conflict(f"round {a.round}: task {a.task_id} has no contribution drawn for audit")
            if a.auditor == a.task_id:
                raise BadRequest("a contribution's peer must be another task")
            if a.state not in self._hub.blobs:
                raise BadRequest(f"peer audit names blob {a.state}, which was never uploaded")
            self._hub.peer_audits.setdefault((a.round, a.task_id), PeerAudit(**a.model_dump()))
            self._hub.assigner = self.task_id

    def peer_audits(self, round: int | None = None) -> PeerAuditList:
        with self._hub.lock:
            audits = [a for (r, _), a in sorted(self._hub.peer_audits.items()) if round in (None, r)]
            if self.task_id != self._hub.assigner:
                audits = [a for a in audits if a.auditor == self.task_id and a.hashes is None]
        return PeerAuditList(audits=audits)

    def report_peer_audit(self, r: PeerAuditReport) -> None:
        with self._hub.lock:
            audit = self._hub.peer_audits.get((r.round, r.task_id))
            if audit is None or audit.auditor != self.task_id:
                raise NotFound(
                    f"round {r.round}: task {self.task_id} was handed no audit of task {r.task_id}"
                )
            if audit.hashes is not None and audit.hashes != r.hashes:
                raise Conflict(f"round {r.round}: the audit of task {r.task_id} was already reported")
            self._hub.peer_audits[r.round, r.task_id] = audit.model_copy(update={"hashes": r.hashes})

    def post_secagg(self, p: SecAggPost) -> None:
        with self._hub.lock:
            if p.kind == "roster" and self._hub.aggregator is None:
                self._hub.aggregator = self.task_id
            existing = self._hub.secagg.setdefault(p.round, [])
            if mailbox.check_post(existing, p, self.task_id, self.task_id == self._hub.aggregator):
                seq = sum(map(len, self._hub.secagg.values()))
                existing.append(SecAggMessage(sender=self.task_id, seq=seq, **p.model_dump()))

    def secagg_messages(self, round: int, after: int = -1) -> SecAggList:
        with self._hub.lock:
            is_aggregator = self.task_id == self._hub.aggregator
            messages = [m for m in self._hub.secagg.get(round, []) if m.seq > after]
            return SecAggList(
                messages=[m for m in messages if mailbox.visible(m, self.task_id, is_aggregator)]
            )

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

    def verdicts(self) -> list[Verdict]:
        """Every verdict reported, newest first (as ``JobDetail.verdicts``)."""
        with self._hub.lock:
            return list(self._hub.verdicts)

    @staticmethod
    def _node(task_id: str) -> str:
        return f"node-{task_id}"

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
