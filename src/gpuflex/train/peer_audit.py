"""Peer audits: a second provider re-runs a drawn contribution's segments, and a core node referees.

With ``verification.peer_segments`` = m, the worker of a drawn contribution uploads the drawn segment
and the m - 1 after it (``AuditState``). The aggregator runs the checks that need no training
(``audit.check_state``) and hands another worker of the job an *order*: the state at the drawn
segment's start and each step's learning rate, nothing the contribution committed to after it. The
peer (on another node, of the worker's hardware class, drawn at random) re-runs the m segments on the
worker's batches, which it draws from the job's seed as the verifier does, and reports the trace hash
after each (``replay``). Where its hashes are the commitment's, the contribution is cleared
(``peer-audit``) and the core node trained not one step for it. Where they differ, the first segment
that differs is in dispute (``first_divergence``: the trace is committed in full, so bisecting it is a
scan of the hashes). Both sides agree on the state before it, so the core node re-runs that one segment
from the worker's uploaded state (``audit.audit``), as Verde's referee re-runs only the first step two
trainers disagree on. The verdict falls on whom the re-run contradicts: the worker whose trace it does
not reproduce, or the peer whose hash it does not (the peer's own contribution to the round is then
convicted: slashed and barred like any guilty one).

Why a second provider: core nodes' compute is what the platform has least of. Peers let a job buy
more coverage (m segments a draw, at the consumer's expense: the peer's time is paid by its lease)
while core nodes re-run only disputes. What it assumes: that the peer, drawn at random among the
round's workers, does not collude with the worker. It is never shown the commitment, but a colluder
told the trace out of band could vouch for it. Peers must share the worker's hardware class: only then
do honest re-runs agree bit for bit. A contribution with no such peer, or whose peer does not report
by the round's deadline, is audited by the core node as without peers.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpuflex.errors import BadRequest, Conflict, NotFound
from gpuflex.protocol.messages import PeerAudit, PeerAuditAssign, PeerAuditReport, VerdictSubmit
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.audit import rerun
from gpuflex.train.checkpoint import load_tensors, save_tensors
from gpuflex.train.commitment import AuditState, Params, Segment, trace_hash
from gpuflex.train.recipes import Batch, Recipe, TaskData, build_model
from gpuflex.train.transport import Transport, fetch_verified
from gpuflex.train.verifier import Judged, Verifier, assigned_batches

_HEADER = "gpuflex-peer-audit"


@dataclass(frozen=True)
class Order:
    """What a peer re-runs: from the training state ``start`` after ``step`` steps, one segment per
    entry of ``lrs`` (each its steps' learning rates, as the aggregator checked them)."""

    step: int
    start: Params
    lrs: list[list[float]]

    @staticmethod
    def of(segment: Segment, lrs: list[list[float]]) -> Order:
        return Order(segment.step, segment.start, lrs)

    @property
    def steps(self) -> int:
        return self.step + sum(len(seg) for seg in self.lrs)

    def to_bytes(self) -> bytes:
        return save_tensors(self.start, {_HEADER: json.dumps({"step": self.step, "lrs": self.lrs})})

    @staticmethod
    def from_bytes(data: bytes) -> Order:
        tensors, metadata = load_tensors(data)
        try:
            header = json.loads(metadata[_HEADER])
            return Order(int(header["step"]), tensors, [[float(x) for x in seg] for seg in header["lrs"]])
        except (KeyError, ValueError, TypeError) as err:
            raise BadRequest(f"not a peer audit order: {err}") from None


@dataclass(frozen=True)
class Delegation:
    """A drawn contribution handed to a peer: the peer, the worker's checked state (the drawn segment
    and the ones after it), and the learning rates of each segment's steps."""

    peer: Judged
    state: AuditState
    lrs: list[list[float]]

    def order(self) -> Order:
        """What the peer is given: the drawn segment's start, and nothing committed after it."""
        return Order.of(self.state.segments[0], self.lrs)


def replay(
    spec: TrainingSpec,
    recipe: Recipe,
    order: Order,
    batches: list[Batch],
    *,
    model: torch.nn.Module | None = None,
    ranks: list[list[Batch]] | None = None,
) -> list[str]:
    """The trace hash after each segment of ``order``, re-run on ``batches`` (the audited worker's, from
    the round's first; ``ranks``: its other ranks', for a replica over several devices)."""
    model = model or build_model(spec, recipe)
    steps = rerun(spec, recipe, model, order.start, order.step, order.lrs, batches, ranks or [])
    return [trace_hash(model, optimizer) for optimizer in steps]


def audit_with_peers(
    verifier: Verifier,
    transport: Transport,
    round: int,
    judged: list[Judged],
    drawn: list[tuple[Judged, bytes | None]],
    deadline: float,
    poll_interval_s: float,
    should_stop: Callable[[], bool],
) -> bool:
    """The aggregator's side: give each drawn contribution (with its audit state, None if none came) its
    verdict through a peer, or the core node's audit where no peer can or did answer by ``deadline``;
    a peer the core node contradicts gets a guilty verdict too. False if told to stop first."""
    load: dict[str, int] = {}
    pending: list[tuple[Judged, Delegation]] = []
    for j, blob in drawn:
        delegated = delegate(verifier, round, j, blob, judged, load)
        if isinstance(delegated, VerdictSubmit):
            j.verdict = delegated
            continue
        assert j.worker is not None, "screened"
        order = PeerAuditAssign(
            round=round,
            task_id=j.contribution.task_id,
            auditor=delegated.peer.contribution.task_id,
            worker=j.worker,
            segment=_drawn(j),
            state=transport.put_blob(delegated.order().to_bytes()),
        )
        try:
            transport.assign_peer_audit(order)
        except (Conflict, NotFound) as err:  # handed out before (by an aggregator since replaced)
            transport.log(f"round {round}: no peer audit of task {order.task_id}: {err.message}")
            j.verdict = settle(verifier, round, j, delegated, None)
            continue
        pending.append((j, delegated))
    reports = _reports(transport, round, len(pending), deadline, poll_interval_s, should_stop)
    if reports is None:
        return False
    for j, delegation in pending:
        verdict = settle(verifier, round, j, delegation, reports.get(j.contribution.task_id))
        if not j.guilty:  # convicted as another's peer already: that verdict stands
            j.verdict = verdict
    return True


def delegate(
    verifier: Verifier, round: int, j: Judged, blob: bytes | None, judged: list[Judged], load: dict[str, int]
) -> VerdictSubmit | Delegation:
    """A drawn contribution's peer and what it hands it; or its verdict where it needs none: the
    no-show's, a failed check's, or the core node's audit when no peer fits. ``load`` counts the
    orders per peer."""
    if blob is None:
        return verifier.audit(round, j, blob)
    checked = verifier.check(round, j, blob, verifier.spec.verification.peer_segments)
    if isinstance(checked, VerdictSubmit):
        return checked
    state, lrs = checked
    peer = choose_peer(j, judged, load)
    if peer is None:
        return verifier.rerun(round, j, state, _drawn(j), lrs[0], "audit")
    load[peer.contribution.task_id] = load.get(peer.contribution.task_id, 0) + 1
    return Delegation(peer, state, lrs)


def _reports(
    transport: Transport,
    round: int,
    expected: int,
    deadline: float,
    poll_interval_s: float,
    should_stop: Callable[[], bool],
) -> dict[str, list[str]] | None:
    """The peers' hashes of ``round``'s orders by audited task, once all ``expected`` are in or at the
    deadline; None if told to stop first."""
    while not should_stop():
        audits = transport.peer_audits(round).audits if expected else []
        reported = {a.task_id: a.hashes for a in audits if a.hashes is not None}
        if len(reported) >= expected or time.monotonic() >= deadline:
            return reported
        time.sleep(poll_interval_s)
    return None


def settle(
    verifier: Verifier, round: int, j: Judged, delegation: Delegation, hashes: list[str] | None
) -> VerdictSubmit:
    """The verdict on ``j`` from its peer's hashes: cleared if they are its trace, else the core node's
    re-run of the first segment where they differ (which convicts the peer if it clears ``j``)."""
    c, peer, lrs = j.contribution, delegation.peer, delegation.lrs
    auditor, first = peer.contribution.task_id, _drawn(j)
    assert c.commitment is not None, "drawn"
    if hashes is None or peer.guilty:  # no answer, or from a worker convicted since: the core node audits
        return verifier.rerun(round, j, delegation.state, first, lrs[0], "audit")
    trace = c.commitment.trace
    diverged = first_divergence(trace, first, hashes, len(lrs))
    evidence = {"peer": auditor, "segment": first, "segments": len(lrs)}
    if diverged is None:
        reason = f"task {auditor} re-ran segments {first} to {first + len(lrs) - 1} to its trace"
        return VerdictSubmit(
            round=round, task_id=c.task_id, guilty=False, check="peer-audit", reason=reason, evidence=evidence
        )
    claimed = hashes[diverged - first] if diverged - first < len(hashes) else None
    verdict = verifier.rerun(round, j, delegation.state, diverged, lrs[diverged - first], "dispute")
    if not verdict.guilty:
        reason = (
            f"its re-run of task {c.task_id}'s segment {diverged} is not what the core node's re-run gives"
        )
        proof = {"task": c.task_id, "segment": diverged, "expected": trace[diverged], "got": claimed}
        peer.verdict = VerdictSubmit(
            round=round, task_id=auditor, guilty=True, check="dispute", reason=reason, evidence=proof
        )
    return verdict.model_copy(
        update={"evidence": {**verdict.evidence, "peer": auditor, "peer_hash": claimed}}
    )


def _drawn(j: Judged) -> int:
    assert j.contribution.audit_segment is not None, "drawn"
    return j.contribution.audit_segment


def first_divergence(trace: list[str], segment: int, hashes: list[str], segments: int) -> int | None:
    """The first of ``segments`` segments from ``segment`` whose trace hash the peer's ``hashes`` do not
    match (a missing hash does not match), or None if all match."""
    for k in range(segments):
        if k >= len(hashes) or hashes[k] != trace[segment + k]:
            return segment + k
    return None


def choose_peer(j: Judged, candidates: list[Judged], load: dict[str, int]) -> Judged | None:
    """A peer for ``j``'s audit: a worker of the round cleared so far, of another task and node and of
    ``j``'s hardware class, among the least loaded (``load``: orders per task this round), at random."""
    c = j.contribution
    assert c.commitment is not None, "screened"
    fit = [
        p
        for p in candidates
        if not p.guilty
        and p.contribution.task_id != c.task_id
        and p.contribution.node_id != c.node_id
        and p.contribution.commitment is not None
        and p.contribution.commitment.device == c.commitment.device
    ]
    if not fit:
        return None
    least = min(load.get(p.contribution.task_id, 0) for p in fit)
    return random.SystemRandom().choice([p for p in fit if load.get(p.contribution.task_id, 0) == least])


@dataclass
class PeerAuditor:
    """A worker's side of peer audits: between rounds, re-run the orders the aggregator handed its task.

    ``vouch`` turns the hashes computed into the hashes reported: honest workers report what they
    computed; an adversary (``adversaries.Framer``) may not."""

    spec: TrainingSpec
    recipe: Recipe
    transport: Transport
    data_for: Callable[[int], TaskData]
    vouch: Callable[[list[str]], list[str]] = list
    seconds: float = 0.0  # re-running orders: verification's cost on this worker
    model: torch.nn.Module | None = None

    def work(self) -> None:
        """Run and report every order waiting for this task."""
        for order in self.transport.peer_audits().audits:
            began = time.perf_counter()
            try:
                hashes = self.run(order)
            except BadRequest as err:
                self.transport.log(f"round {order.round}: peer audit of task {order.task_id} failed: {err}")
                continue
            finally:
                self.seconds += time.perf_counter() - began
            try:
                self.transport.report_peer_audit(
                    PeerAuditReport(round=order.round, task_id=order.task_id, hashes=self.vouch(hashes))
                )
            except (Conflict, NotFound) as err:
                self.transport.log(f"round {order.round}: peer audit report refused: {err.message}")
                continue
            span = f"segments {order.segment} to {order.segment + len(hashes) - 1}"
            self.transport.log(f"round {order.round}: re-ran {span} of task {order.task_id} as its peer")

    def run(self, order: PeerAudit) -> list[str]:
        work = Order.from_bytes(fetch_verified(self.transport, order.state))
        self.model = self.model or build_model(self.spec, self.recipe)
        data = self.data_for(order.worker)

        def draw(rank: int) -> list[Batch]:
            return assigned_batches(self.spec, data, order.worker, order.round, rank, work.steps)

        ranks = [draw(rank) for rank in range(1, self.spec.local_devices)]
        return replay(self.spec, self.recipe, work, draw(0), model=self.model, ranks=ranks)


__all__ = [
    "Delegation",
    "Order",
    "PeerAuditor",
    "audit_with_peers",
    "choose_peer",
    "delegate",
    "first_divergence",
    "replay",
    "settle",
]
