"""Audits: re-execute one trace segment of a contribution from the state its worker uploaded.

The auditor (the aggregator, on a trusted core node) gets the state at the start of the drawn segment
and at its end, the final state and the residual (``commitment.AuditState``) and checks, cheapest first:

1. the start state hashes to the commitment: ``trace[seg - 1]``, or ``start`` for segment 0 (its
   parameters; the optimizer state a round starts from is the worker's own business);
2. the batches the worker's seed draws over the whole round (the caller draws them) hash to ``data``
   (no training: a worker that trained on other batches and claims these is caught by step 4);
3. the learning rates are the schedule's (with ``round_seconds`` they depend on the worker's clock,
   so they are only checked to lie between the schedule's values at the round's start and end);
4. ``every`` inner steps re-run from that state land on ``trace[seg]``: bit for bit when the auditor is
   of the worker's hardware class (``commitment.device``); otherwise the uploaded end state must hash
   to ``trace[seg]`` and the re-run must land within ``TOLERANCE`` of it (relative L2 distance over
   parameters and moments: float reductions reorder across devices, a shirker's bf16 or skipped
   steps land orders of magnitude further).

Between 3 and 4 it checks the binding of the delta to the trace (``_binding``): the final training
state (hashing to ``trace[-1]``), the round's start parameters (hashing to ``start``) and the
error-feedback residual (hashing to ``residual``) must give the submitted blob: the job's compressor
applied to ``start - final params + decay·residual`` decodes to the submitted delta, bit for bit on
the worker's hardware class, else within ``TOLERANCE`` (the same relative L2 distance). A worker that
trained honestly and sent something else (ALIE, a substitution) fails here. The residual that compression
left must be the committed ``residual_out`` (on another hardware class: the uploaded one hashes to it and
lies within ``TOLERANCE`` of the auditor's). The verifier holds every contribution's residual to its
previous contribution's ``residual_out``, so this chain leaves a cheater no residual of its choosing:
one forged to bind a poisoned delta (its poisoned vector plus its real residual minus its honest delta)
breaks the chain at the screen, or, committed as the previous round's residual left, fails here.

A mismatch is guilty, with evidence: the segment, which ``binding`` failed (final, origin, residual,
residual_out, delta) and the expected and computed values. One audit costs ``every`` inner steps and one
compression, so auditing a share ``a`` of contributions costs about ``a / segments`` of training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import Commitment
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.commitment import (
    TRACE_HEX,
    AuditState,
    Params,
    Segment,
    data_hash,
    deterministic,
    device_class,
    load_state,
    params_hash,
    residual_hash,
    trace_hash,
    training_state,
)
from gpuflex.train.compression import get_compressor, with_residual
from gpuflex.train.optimizers import InnerOptimizer, inner_optimizer
from gpuflex.train.precision import InnerStep
from gpuflex.train.recipes import Batch, Recipe, build_model
from gpuflex.train.schedule import lr_factor, lr_range
from gpuflex.train.worker import step

TOLERANCE = 1e-3  # across hardware classes: relative L2 distance of the re-run end state to the uploaded one
LR_RTOL = 1e-9  # learning rates are recomputed from the same formula: equal up to float formatting

Evidence = dict[str, str | float | int | None]


@dataclass(frozen=True)
class Finding:
    guilty: bool
    reason: str
    evidence: Evidence = field(default_factory=dict)
    compute_s: float = 0.0  # what the audit cost the auditor


@dataclass(frozen=True)
class Claim:
    """What is audited: a contribution's commitment, its claimed steps and round, the drawn segment."""

    round: int
    steps: int
    commitment: Commitment
    segment: int
    delta: Params  # the submitted blob, decoded


def audit(
    spec: TrainingSpec,
    recipe: Recipe,
    batches: list[Batch],
    claim: Claim,
    blob: bytes,
    *,
    model: torch.nn.Module | None = None,
    ranks: list[list[Batch]] | None = None,
) -> Finding:
    """Re-execute ``claim.segment`` from ``blob`` (the worker's ``AuditState``) against the commitment,
    and check that the submitted delta is the compressed difference of the round's start and last state.

    ``batches``: the round's batches the commitment's seed draws from the worker's shard, in order.
    ``model``: one of the recipe's models to re-run in (overwritten), to spare building one per audit.
    ``ranks``: for a replica over several devices, the batches each other rank drew (at least up to the
    segment's end): each step re-runs on the mean gradient of all ranks' batches."""
    began = time.perf_counter()
    try:
        state = AuditState.from_bytes(blob)
        checked = check_state(spec, batches, claim, state, segments=1)
    except BadRequest as err:
        checked = Finding(True, f"its audit state is unreadable: {err.message}")
    if isinstance(checked, Finding):
        evidence = {"segment": claim.segment, **checked.evidence}
        return Finding(True, checked.reason, evidence, time.perf_counter() - began)
    finding = rerun_segment(spec, recipe, batches, claim, state, checked[0], model=model, ranks=ranks)
    return Finding(finding.guilty, finding.reason, finding.evidence, time.perf_counter() - began)


def rerun_segment(
    spec: TrainingSpec,
    recipe: Recipe,
    batches: list[Batch],
    claim: Claim,
    state: AuditState,
    lrs: list[float],
    *,
    model: torch.nn.Module | None = None,
    ranks: list[list[Batch]] | None = None,
) -> Finding:
    """Step 4 alone, on a state that passed the other checks (``check_state``, which gave ``lrs``):
    re-run ``claim.segment`` from its start in ``state`` and compare with the trace."""
    began = time.perf_counter()
    finding = _rerun_segment(spec, recipe, batches, claim, state, lrs, model, ranks or [])
    evidence = {"segment": claim.segment, **finding.evidence}
    return Finding(finding.guilty, finding.reason, evidence, time.perf_counter() - began)


def _rerun_segment(
    spec: TrainingSpec,
    recipe: Recipe,
    batches: list[Batch],
    claim: Claim,
    state: AuditState,
    lrs: list[float],
    model: torch.nn.Module | None,
    ranks: list[list[Batch]],
) -> Finding:
    c = claim.commitment
    seg = state.segment(claim.segment * c.every)
    if seg is None:
        return Finding(True, f"its audit state does not hold segment {claim.segment}")
    model = model or build_model(spec, recipe)
    try:
        optimizer = next(rerun(spec, recipe, model, seg.start, seg.step, [lrs], batches, ranks))
    except BadRequest as err:
        return Finding(True, f"its audit state does not fit the model: {err.message}")
    expected, got = c.trace[claim.segment], trace_hash(model, optimizer)
    if c.device == _own_class(spec):
        if expected != got:
            return Finding(
                True, f"re-running segment {claim.segment} does not reproduce its trace", _diff(expected, got)
            )
        return Finding(
            False, f"segment {claim.segment} re-ran bit for bit to its trace", _diff(expected, got)
        )
    return _within_tolerance(seg, expected, training_state(model, optimizer))


def check_state(
    spec: TrainingSpec, batches: list[Batch], claim: Claim, state: AuditState, segments: int
) -> Finding | list[list[float]]:
    """The checks of an audit that need no training (1-3 and the binding) on ``segments`` segments of
    ``state`` from the claim's: a guilty finding, or the learning rates to re-run each with."""
    c, first = claim.commitment, claim.segment * claim.commitment.every
    seg = state.segment(first)
    if seg is None:
        held = [s.step for s in state.segments]
        return Finding(
            True, "its audit state is not at the segment's start", {"expected": first, "got": str(held)}
        )
    params = {k.removeprefix("p."): v for k, v in seg.start.items() if k.startswith("p.")}
    if claim.segment == 0:
        expected, got = c.start, params_hash(params)
    else:
        expected, got = c.trace[claim.segment - 1], params_hash(seg.start)[:TRACE_HEX]
    if expected != got:
        return Finding(
            True, "its state at the segment's start is not the committed one", _diff(expected, got)
        )
    digest = data_hash(batches)
    if len(batches) != claim.steps or digest != c.data:
        return Finding(True, "its seed does not draw the batches it committed to", _diff(c.data, digest))
    lrs = []
    for index in range(claim.segment, min(claim.segment + segments, len(c.trace))):
        seg, step = state.segment(index * c.every), index * c.every
        if seg is None:
            return Finding(True, f"its audit state does not hold segment {index}", {"expected": step})
        count = min(c.every, claim.steps - step)
        segment_lrs, bad = _learning_rates(spec, claim.round, step, count, seg.lrs)
        if bad:
            return Finding(True, bad, {"segment": index, "got": str(seg.lrs[:8])})
        lrs.append(segment_lrs)
    return _binding(spec, claim, state, c.device == _own_class(spec)) or lrs


def _own_class(spec: TrainingSpec) -> str:
    """The auditor's hardware class: this process's CPU, in the job's precision as a CPU runs it."""
    cpu = torch.device("cpu")
    return device_class(cpu, InnerStep.for_spec(spec, cpu).label, spec.quantize_base)


def rerun(
    spec: TrainingSpec,
    recipe: Recipe,
    model: torch.nn.Module,
    start: Params,
    step_: int,
    lrs: list[list[float]],
    batches: list[Batch],
    ranks: list[list[Batch]],
) -> Iterator[InnerOptimizer]:
    """Re-run segment after segment (``lrs``: each one's steps) from the training state ``start``, after
    ``step_`` steps of the round: yields the optimizer after each (``model`` moves in place)."""
    optimizer = _restore(spec, model, start)
    inner = InnerStep.for_spec(spec, torch.device("cpu"))
    k = step_
    for segment_lrs in lrs:
        with deterministic():
            for lr in segment_lrs:
                for group in optimizer.param_groups:
                    group["lr"] = lr
                step(recipe, model, model, optimizer, batches[k], *(rank[k] for rank in ranks), inner=inner)
                k += 1
        yield optimizer


def _binding(spec: TrainingSpec, claim: Claim, state: AuditState, same_class: bool) -> Finding | None:
    """Why the submitted delta is not ``compress(origin - final params + residual)``, or the residual
    left not what that compression left, or None if both are."""
    c = claim.commitment
    final, origin = state.final_state(), state.origin_params()
    hashes = (
        ("final", "its final state is not the trace's last", c.trace[-1], params_hash(final)[:TRACE_HEX]),
        ("origin", "its round's start is not the committed one", c.start, params_hash(origin)),
        ("residual", "its residual is not the committed one", c.residual, residual_hash(state.residual)),
        (
            "residual_out",
            "the residual it left is not the committed one",
            c.residual_out,
            residual_hash(state.residual_out),
        ),
    )
    for binding, reason, expected, got in hashes:
        if expected != got:
            return Finding(True, reason, {"binding": binding, **_diff(str(expected), got)})
    shapes = {n: t.shape for n, t in claim.delta.items()}
    states = (origin, {n: final.get(f"p.{n}") for n in shapes}, state.residual, state.residual_out)
    if set(origin) != set(shapes) or any(
        t is None or t.shape != shapes.get(n) for part in states for n, t in part.items()
    ):
        return Finding(
            True, "its start, final state or residual does not fit the model", {"binding": "delta"}
        )
    trained = {n: origin[n] - final[f"p.{n}"] for n in origin}
    corrected = with_residual(trained, state.residual, spec.compression.error_decay)
    try:
        rebuilt = get_compressor(spec.compression).echo(corrected)
    except ValueError as err:  # non-finite values
        return Finding(True, f"its training and residual do not compress: {err}", {"binding": "delta"})
    left = {n: corrected[n] - rebuilt[n] for n in corrected}
    pairs = (
        ("delta", "its delta is not its training compressed with its residual", claim.delta, rebuilt),
        ("residual_out", "the residual it left is not what compression left", state.residual_out, left),
    )
    for binding, reason, got, expected in pairs:
        if got.keys() != expected.keys():
            return Finding(True, reason, {"binding": binding})
        if same_class:
            if any(not torch.equal(got[n], expected[n]) for n in expected):
                return Finding(True, reason, {"binding": binding})
            continue
        distance = _distance(got, expected)
        if distance > TOLERANCE:
            return Finding(True, reason, {"binding": binding, "distance": distance, "tolerance": TOLERANCE})
    return None


def _distance(got: Params, reference: Params) -> float:
    """Relative L2 distance of ``got`` to ``reference`` (same tensor names)."""
    num = sum(float((got[k].double() - reference[k].double()).pow(2).sum()) for k in reference)
    den = sum(float(reference[k].double().pow(2).sum()) for k in reference)
    return math.sqrt(num / max(den, 1e-30))


def _diff(expected: str, got: str) -> Evidence:
    return {"expected": expected, "got": got}


def _learning_rates(
    spec: TrainingSpec, round: int, first: int, count: int, claimed: list[float]
) -> tuple[list[float], str | None]:
    """The lrs to re-run with, or why the claimed ones are wrong."""
    if len(claimed) != count:
        return [], f"its audit state lists {len(claimed)} learning rates for {count} steps"
    if spec.round_seconds is None:
        schedule = [
            spec.lr * lr_factor(spec, (round + (first + k) / spec.inner_steps) / spec.rounds)
            for k in range(count)
        ]
        if any(not math.isclose(a, b, rel_tol=LR_RTOL) for a, b in zip(schedule, claimed, strict=True)):
            return [], "its learning rates are not the schedule's"
        return schedule, None
    least, greatest = lr_range(spec, round)
    low, high = spec.lr * least * (1 - LR_RTOL), spec.lr * greatest * (1 + LR_RTOL)
    if any(not low <= lr <= high for lr in claimed):
        return [], "its learning rates are outside the schedule's range for the round"
    return claimed, None


def _restore(spec: TrainingSpec, model: torch.nn.Module, state: Params) -> InnerOptimizer:
    """Load ``state`` into ``model`` and a fresh inner optimizer (``commitment.load_state``)."""
    optimizer = inner_optimizer(model, spec)
    load_state(model, optimizer, state)
    return optimizer


def _within_tolerance(seg: Segment, expected: str, computed: Params) -> Finding:
    uploaded = params_hash(seg.end)[:TRACE_HEX]
    if uploaded != expected:
        return Finding(True, "its uploaded end state is not the committed one", _diff(expected, uploaded))
    if seg.end.keys() != computed.keys():
        return Finding(True, "its uploaded end state has other tensors than the re-run's")
    distance = _distance(seg.end, computed)
    evidence: Evidence = {"distance": distance, "tolerance": TOLERANCE}
    if distance > TOLERANCE:
        return Finding(True, "re-running the segment on another hardware class lands too far", evidence)
    return Finding(False, "the segment re-ran within tolerance on another hardware class", evidence)
