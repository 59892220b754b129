"""The aggregator's verifier: judges one round's contributions before they are averaged.

Checks, cheapest first; the first that fails convicts (``check="screen"``):

1. a commitment, and one that fits the round: a seed this round assigns to some worker (which also
   says whose shard it trained on), the round's start (unless workers ``overlap``, whose start is their
   own), a residual (what binds the delta to the trace) that is the one its task's previous
   contribution left, with a chain count one more (``Contribution.carried``, ``carried_chain``), or
   empty with a count of 0 (a fresh worker's), the residual it leaves (the next one's), the spec's
   ``every``, a trace as long as its claimed steps need, no more steps than the round; and its ``data``
   hash equals the batches that seed draws (sampling only). A stale replay fails here.
2. ``robust.screen``: norm against the median, cosine against the others' robust center. A delta's
   lower bound is set by the deltas whose residual chains are no longer than its own: a worker that
   joined later (a replacement node) compresses with a residual that has carried less mass over
   fewer rounds (honest joiners measured 0.30-0.43x the median of the others in
   ``bench/verification.py``'s jobs). Such a ``fresh`` delta's cosine says nothing (an honest joiner's
   measured −0.014); the loss test below judges it in full instead, so claiming an empty residual
   escapes no check.
3. loss gain: the delta applied where the worker began must lower the loss on its own assigned batches.
   That is the round's model, or with ``overlap`` the previous round's model less the worker's own
   previous delta (its one-round-delayed start, ``worker.py``; the previous round's blob stands in for
   the exact delta it kept): judged from the round's model instead, an overlapped honest delta
   overshoots by what the average moved, and ``bench/diloco_vs_ddp.py``'s int2-overlap job convicted 3
   of its 4 honest workers (a job whose workers are all convicted waits for a round nobody will
   contribute to). Where the verifier did not see the worker's previous delta (a stale one, a joiner, a
   resumed aggregator), the round's model stands in. Each is first tried on the last batch it drew (two
   forward passes); one that shows no gain there, or is ``fresh``, is judged on up to
   ``CONFIRM_BATCHES`` of its batches, along the delta and against it: the difference is its first-order
   descent, the sum its curvature cost. It is convicted if its descent is under ``DESCENT_MIN`` × that
   cost. Honest deltas do not always lower the loss: past a small model's plateau, or with a large
   learning rate, training can overshoot ("gain <= 0 on the last batch" convicted 5 of 120 honest
   contributions in 60 rounds of the integration tests' job; "gain <= 0 on all of them", 1 of 120 in
   ``bench/verification.py``'s plateau job), but an overshooting delta still points downhill (descent
   near the cost or above). Noise points nowhere (descent near 0), a flipped delta uphill; both cost as
   much as an honest delta of their length.
4. duplicates: contributions claiming one worker's batches: all but the one whose delta fits them best,
   against as many other batches of the shard, are convicted (training fits the batches trained on).

What screening does not convict, on purpose: a copied delta (a free-rider's; colluders' shared ALIE
vector). Which of two equal deltas is the original only an audit can tell — the copier's trace is made
up — and the memorization margin above is noise around zero for honest workers on a tiny model
(measured), so tie-breaking by it convicted honest victims. Copies are left to the audits, and so is an
ALIE vector, which passes every screen (it stays inside the honest spread): its worker trained honestly,
so only the audit's binding of the delta to the trace (``audit.py``) convicts it; unaudited, the
clipping bounds its pull.

Audits (``audit.py``) run on the drawn contributions that pass screening, once their state is in
(``Verifier.audit``). ``compute_s`` adds up what all of this cost, ``audit_s`` the audits' share of it
(which scales with the audit rate, screening does not), for the benchmark's extra compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import Contribution, VerdictCheck, VerdictSubmit
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.audit import Claim, Finding, audit, check_state, rerun_segment
from gpuflex.train.commitment import EMPTY_RESIDUAL, AuditState, data_hash, trace_every
from gpuflex.train.data import round_generator, round_seed
from gpuflex.train.recipes import Batch, Recipe, TaskData, build_model
from gpuflex.train.robust import THRESHOLDS, Delta, Thresholds, flatten, fresh, screen
from gpuflex.train.schedule import lr_share
from gpuflex.train.trainable import trainable

MARGIN_BATCHES = 1  # assigned batches (the last ones drawn) a duplicate claim is judged on
CONFIRM_BATCHES = 8  # at most, evenly spread to the last: assigned batches that confirm a suspicion
# × the curvature: the least first-order descent a suspect must show (the 16 honest suspects of
# bench/verification.py's 60-round plateau job measured 1.01-4.15)
DESCENT_MIN = 0.5
OTHER_SALT = 0x5EED  # seeds the "other batches of the shard" apart from every assigned stream

Checked = tuple[AuditState, list[list[float]]]  # an audit state that passed the checks, each segment's lrs


@dataclass(frozen=True)
class Previous:
    """An overlapped job's last screened round: its model and each worker's delta (``Verifier._origin``)."""

    round: int
    params: Delta
    deltas: dict[int, Delta]


@dataclass
class Judged:
    contribution: Contribution
    delta: Delta
    verdict: VerdictSubmit | None = None  # guilty, or an audit's finding
    worker: int | None = None  # whose batches its seed draws
    batches: list[Batch] = field(default_factory=list)  # the round's batches its seed draws from that shard

    @property
    def guilty(self) -> bool:
        return self.verdict is not None and self.verdict.guilty


class Verifier:
    def __init__(
        self,
        spec: TrainingSpec,
        recipe: Recipe,
        data_for: Callable[[int], TaskData],
        num_workers: int,
        thresholds: Thresholds = THRESHOLDS,
    ):
        self.spec = spec
        self.recipe = recipe
        self.data_for = data_for
        self.num_workers = num_workers
        self.thresholds = thresholds
        self.scratch = build_model(spec, recipe)
        self.compute_s = 0.0
        self.audit_s = 0.0
        self.previous: Previous | None = None  # with ``overlap``: the last round screened, for ``_origin``

    def screen(
        self, round: int, params: Delta, state_hash: str, arrived: list[tuple[Contribution, Delta]]
    ) -> list[Judged]:
        """Every contribution of ``round``, judged against the round's model ``params``."""
        began = time.perf_counter()
        judged = [Judged(c, d) for c, d in arrived]
        seeds = {round_seed(self.spec.seed, i, round): i for i in range(self.num_workers)}
        for j in judged:
            reason = self._commitment(j, round, state_hash, seeds)
            if reason:
                self._convict(j, round, reason, {})
        alive = [j for j in judged if not j.guilty]
        shares = [lr_share(self.spec, round, j.contribution.steps) for j in alive]
        chains = [j.contribution.commitment.chain for j in alive]
        for j, found in zip(
            alive, screen([flatten(j.delta) for j in alive], shares, self.thresholds, chains), strict=True
        ):
            if found is not None:
                self._convict(j, round, found[0], found[1])
        young = {id(j) for j, is_fresh in zip(alive, fresh(chains), strict=True) if is_fresh}
        self._loss_gain(round, params, [j for j in judged if not j.guilty], young)
        if self.spec.overlap:
            deltas = {j.worker: j.delta for j in judged if j.worker is not None}
            self.previous = Previous(round, {n: p.clone() for n, p in params.items()}, deltas)
        self.compute_s += time.perf_counter() - began
        return judged

    def _origin(self, round: int, params: Delta, j: Judged) -> Delta:
        """Where ``j``'s worker began the round (check 3)."""
        last = self.previous
        if not self.spec.overlap or last is None or last.round != round - 1 or j.worker not in last.deltas:
            return params
        own = last.deltas[j.worker]
        return {n: p - own[n] for n, p in last.params.items()}

    def audit(self, round: int, j: Judged, blob: bytes | None) -> VerdictSubmit:
        """The finding of a drawn contribution's audit; no state is a no-show."""
        c = j.contribution
        if blob is None:
            return self._verdict(round, c, True, "no-show", "its audit state never came", {})
        claim = self._claim(round, j, None)
        end = min(c.steps, (claim.segment + 1) * claim.commitment.every)
        ranks = [self._batches(j.worker, round, rank, end) for rank in range(1, self.spec.local_devices)]
        finding = audit(self.spec, self.recipe, j.batches, claim, blob, model=self.scratch, ranks=ranks)
        self._spent(finding.compute_s)
        return self._verdict(round, c, finding.guilty, "audit", finding.reason, finding.evidence)

    def check(self, round: int, j: Judged, blob: bytes, segments: int) -> VerdictSubmit | Checked:
        """An audit's checks that need no training, over ``segments`` segments from the drawn one (what a
        peer re-runs): a guilty verdict, or the state read and the learning rates of each to re-run."""
        began = time.perf_counter()
        claim = self._claim(round, j, None)
        try:
            state = AuditState.from_bytes(blob)
            checked = check_state(self.spec, j.batches, claim, state, segments)
        except BadRequest as err:
            checked = Finding(True, f"its audit state is unreadable: {err.message}")
        self._spent(time.perf_counter() - began)
        if isinstance(checked, Finding):
            evidence = {"segment": claim.segment, **checked.evidence}
            return self._verdict(round, j.contribution, True, "audit", checked.reason, evidence)
        return state, checked

    def rerun(
        self, round: int, j: Judged, state: AuditState, segment: int, lrs: list[float], check: VerdictCheck
    ) -> VerdictSubmit:
        """The finding of re-running ``segment`` of a checked state (``check``) with its ``lrs``."""
        claim = self._claim(round, j, segment)
        end = min(j.contribution.steps, (segment + 1) * claim.commitment.every)
        ranks = [self._batches(j.worker, round, rank, end) for rank in range(1, self.spec.local_devices)]
        finding = rerun_segment(
            self.spec, self.recipe, j.batches, claim, state, lrs, model=self.scratch, ranks=ranks
        )
        self._spent(finding.compute_s)
        return self._verdict(round, j.contribution, finding.guilty, check, finding.reason, finding.evidence)

    def _spent(self, seconds: float) -> None:
        self.compute_s += seconds
        self.audit_s += seconds

    @staticmethod
    def _claim(round: int, j: Judged, segment: int | None) -> Claim:
        c = j.contribution
        assert c.commitment is not None and c.audit_segment is not None and j.worker is not None, "screened"
        return Claim(round, c.steps, c.commitment, c.audit_segment if segment is None else segment, j.delta)

    def _commitment(self, j: Judged, round: int, state_hash: str, seeds: dict[int, int]) -> str | None:
        c, spec = j.contribution, self.spec
        if c.commitment is None:
            return "it carries no commitment"
        m = c.commitment
        j.worker = seeds.get(m.seed)
        if j.worker is None:
            return "its seed is not one this round assigns"
        if not spec.overlap and m.start != state_hash:
            return f"it did not start from round {round}'s model"
        if m.residual is None or m.residual_out is None:
            return "its commitment names no residual: its delta is bound to nothing"
        if m.residual == EMPTY_RESIDUAL:
            if m.chain:
                return f"its residual is empty, yet it claims {m.chain} compressions"
        elif m.residual != c.carried:
            return "its residual is not the one its previous contribution left"
        elif c.carried_chain is None or m.chain != c.carried_chain + 1:
            return f"its chain of {m.chain} compressions does not follow its previous contribution's"
        if m.every != trace_every(spec):
            return f"its trace is every {m.every} steps, the job's every {trace_every(spec)}"
        if not 0 < c.steps <= spec.inner_steps or len(m.trace) != -(-c.steps // m.every):
            return f"its trace has {len(m.trace)} hashes for the {c.steps} steps it claims"
        j.batches = self._batches(j.worker, round, 0, c.steps)
        if data_hash(j.batches) != m.data:
            return "the batches it committed to are not the ones its seed draws"
        return None

    def _batches(self, worker: int, round: int, rank: int, count: int) -> list[Batch]:
        return assigned_batches(self.spec, self.data_for(worker), worker, round, rank, count)

    def _loss_gain(self, round: int, params: Delta, alive: list[Judged], young: set[int]) -> None:
        """``young``: ids of the ``fresh`` deltas the cosine screen passed over, judged on every
        confirming batch."""
        for j in alive:
            origin = self._origin(round, params, j)
            if id(j) not in young and self._gain(origin, j.delta, j.batches[-1:]) > 0:
                continue
            # a suspicion: along the delta and against it, on the batches it claims
            batches = spread(j.batches, CONFIRM_BATCHES)
            base, along, against = self._losses(origin, j.delta, batches, (0.0, 1.0, -1.0))
            descent = (against - along) / 2  # first order: how much the delta points downhill
            curvature = (along + against) / 2 - base  # second order: what its length costs
            if descent <= DESCENT_MIN * max(curvature, 0.0):
                reason = "it does not lower the loss on its own assigned batches"
                self._convict(j, round, reason, {"descent": descent, "curvature": curvature})
        self._duplicates(round, [j for j in alive if not j.guilty], params)

    def _duplicates(self, round: int, alive: list[Judged], params: Delta) -> None:
        by_worker: dict[int | None, list[Judged]] = {}
        for j in alive:
            by_worker.setdefault(j.worker, []).append(j)
        for claimants in (c for c in by_worker.values() if len(c) > 1):
            margins = [self._margin(round, params, j) for j in claimants]
            best = max(range(len(claimants)), key=margins.__getitem__)
            for k, j in enumerate(claimants):
                if k != best:
                    other = claimants[best].contribution.task_id
                    reason = f"it claims worker {j.worker}'s batches, as task {other} does"
                    self._convict(j, round, reason, {"margin": margins[k], "best_margin": margins[best]})

    def _margin(self, round: int, params: Delta, j: Judged) -> float:
        """Loss gain on its own assigned batches minus on as many other batches of its shard."""
        worker = j.worker or 0
        generator = torch.Generator().manual_seed(round_seed(self.spec.seed, worker, round) ^ OTHER_SALT)
        others = [self.data_for(worker).sample(generator) for _ in range(MARGIN_BATCHES)]
        origin = self._origin(round, params, j)
        return self._gain(origin, j.delta, j.batches[-MARGIN_BATCHES:]) - self._gain(origin, j.delta, others)

    def _gain(self, params: Delta, delta: Delta, batches: list[Batch]) -> float:
        """Mean loss on ``batches`` at ``params`` minus at ``params − delta``."""
        base, moved = self._losses(params, delta, batches, (0.0, 1.0))
        return base - moved

    def _losses(
        self, params: Delta, delta: Delta, batches: list[Batch], moves: tuple[float, ...]
    ) -> list[float]:
        """Mean loss on ``batches`` at ``params − t × delta`` for each t in ``moves``."""
        losses = []
        with torch.no_grad():
            for t in moves:
                for name, p in trainable(self.scratch).items():
                    p.copy_(params[name] - t * delta[name])
                losses.append(sum(self.recipe.loss(self.scratch, b).item() for b in batches) / len(batches))
        return losses

    def _convict(self, j: Judged, round: int, reason: str, numbers: dict[str, float]) -> None:
        j.verdict = self._verdict(round, j.contribution, True, "screen", reason, dict(numbers))

    @staticmethod
    def _verdict(
        round: int, c: Contribution, guilty: bool, check: VerdictCheck, reason: str, evidence: dict
    ) -> VerdictSubmit:
        return VerdictSubmit(
            round=round, task_id=c.task_id, guilty=guilty, check=check, reason=reason, evidence=evidence
        )


def assigned_batches(
    spec: TrainingSpec, data: TaskData, worker: int, round: int, rank: int, count: int
) -> list[Batch]:
    """The first ``count`` batches ``rank`` of ``worker``'s replica draws from its shard ``data`` in
    ``round`` (rank 0: the seed its commitment names): what an auditor re-runs it on."""
    generator = round_generator(spec.seed, worker, round, rank)
    return [data.sample(generator) for _ in range(count)]


def spread(batches: list[Batch], most: int) -> list[Batch]:
    """At most ``most`` of ``batches``, evenly spaced and ending with the last."""
    n = len(batches)
    return batches if n <= most else [batches[(i + 1) * n // most - 1] for i in range(most)]
