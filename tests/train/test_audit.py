"""Audits: an honest segment re-runs bit for bit and its delta is bound to its trace; a tampered one is
guilty, with evidence."""

import dataclasses

import pytest
import torch

from gpuflex.train.audit import TOLERANCE, Claim, audit
from gpuflex.train.commitment import TRACE_HEX, AuditState, params_hash, residual_hash
from gpuflex.train.drill import Drill

from .helpers import tiny_spec


@pytest.fixture(scope="module", params=["adamw", "muon"])
def honest(corpus, request):
    """A worker's round 1 of 2, trained honestly with each inner optimizer (a round in: its moments are
    no longer zero). Warm-up peaks at progress 0.6, inside round 1 (0.5 to 1.0)."""
    spec = tiny_spec(
        inner_optimizer=request.param,
        rounds=2,
        inner_steps=4,
        warmup=0.6,
        verification={"trace_every": 2},
        compression={"method": "topk", "density": 0.1, "values": "int8", "error_decay": 0.9},
    )
    drill = Drill(spec, corpus, [None, None])
    drill.round(0, lambda w, c: None)
    judged, results = drill.round(1, lambda w, c: None)
    return drill, judged[0], results[0]


def _audit(drill, j, result, segment, blob=None, commitment=None, delta=None):
    claim = Claim(1, j.contribution.steps, commitment or result.commitment, segment, delta or j.delta)
    return audit(drill.spec, drill.recipe, j.batches, claim, blob or result.audit_state(segment))


def test_each_honest_segment_reruns_to_its_trace(honest):
    drill, j, result = honest
    for segment in range(2):
        finding = _audit(drill, j, result, segment)
        assert not finding.guilty, finding
        assert finding.evidence["expected"] == finding.evidence["got"] and finding.compute_s > 0


def test_a_changed_trace_a_foreign_state_and_a_wrong_seed_are_guilty(honest):
    drill, j, result = honest
    c = result.commitment
    forged = c.model_copy(update={"trace": ["0" * 16, *c.trace[1:]]})
    finding = _audit(drill, j, result, 0, commitment=forged)
    assert (
        finding.guilty and "does not reproduce" in finding.reason and finding.evidence["expected"] == "0" * 16
    )
    assert _audit(drill, j, result, 1, blob=result.audit_state(0)).guilty  # the wrong segment's state
    other_seed = c.model_copy(update={"seed": c.seed + 1})
    assert (
        _audit(drill, j, result, 0, commitment=other_seed).guilty is False
    )  # the seed is the verifier's check
    assert _audit(drill, j, result, 0, blob=b"junk").guilty


def test_a_time_budgeted_round_where_warm_up_ends_may_use_the_peak_lr(honest):
    # the lrs of round 1's steps rise above those at both its ends (0.83 and 0.1 of the peak); a worker
    # whose clock put a step near the peak is honest
    drill, j, result = honest
    timed = drill.spec.model_copy(update={"round_seconds": 60.0})
    claim = Claim(1, j.contribution.steps, result.commitment, 0, j.delta)
    finding = audit(timed, drill.recipe, j.batches, claim, result.audit_state(0))
    assert not finding.guilty, finding


def test_another_hardware_class_is_judged_within_tolerance(honest):
    drill, j, result = honest
    elsewhere = result.commitment.model_copy(update={"device": "cuda:8.0"})
    assert not _audit(drill, j, result, 1, commitment=elsewhere).guilty
    state = AuditState.from_bytes(result.audit_state(0))  # not the last segment: its end is not final
    end = state.segments[0].end
    nudged = {k: v + 1e-2 * v.abs().mean() if k.startswith("p.") else v for k, v in end.items()}
    moved = dataclasses.replace(state, segments=(dataclasses.replace(state.segments[0], end=nudged),))
    trace = [params_hash(nudged)[:TRACE_HEX], *result.commitment.trace[1:]]
    forged = elsewhere.model_copy(update={"trace": trace})
    finding = _audit(drill, j, result, 0, blob=moved.to_bytes(), commitment=forged)
    assert finding.guilty and "binding" not in finding.evidence
    assert finding.evidence["distance"] > TOLERANCE and torch.isfinite(
        torch.tensor(finding.evidence["distance"])
    )


def test_a_delta_other_than_its_training_compressed_is_guilty_naming_the_binding(honest):
    drill, j, result = honest
    scaled = {n: 1.01 * t for n, t in j.delta.items()}
    for segment in range(2):
        finding = _audit(drill, j, result, segment, delta=scaled)
        assert finding.guilty and finding.evidence["binding"] == "delta", finding
    state = AuditState.from_bytes(result.audit_state(0))
    other = {n: t + 1e-3 for n, t in state.residual.items()}
    finding = _audit(drill, j, result, 0, blob=dataclasses.replace(state, residual=other).to_bytes())
    assert finding.guilty and finding.evidence["binding"] == "residual"
    finding = _audit(
        drill, j, result, 0, blob=dataclasses.replace(state, final=state.segments[0].start).to_bytes()
    )
    assert finding.guilty and finding.evidence["binding"] == "final"
    state = AuditState.from_bytes(result.audit_state(1))
    finding = _audit(
        drill, j, result, 1, blob=dataclasses.replace(state, origin=state.segments[0].start).to_bytes()
    )
    assert finding.guilty and finding.evidence["binding"] == "origin"
    poisoned = {n: torch.full_like(t, float("nan")) for n, t in state.residual.items()}
    committed = result.commitment.model_copy(update={"residual": residual_hash(poisoned)})
    blob = dataclasses.replace(state, residual=poisoned).to_bytes()
    finding = _audit(drill, j, result, 1, blob=blob, commitment=committed)
    assert finding.guilty and "do not compress" in finding.reason  # a verdict, not a crash
    elsewhere = result.commitment.model_copy(update={"device": "cuda:8.0"})
    assert not _audit(drill, j, result, 1, commitment=elsewhere).guilty  # within tolerance of itself
    assert _audit(drill, j, result, 1, commitment=elsewhere, delta=scaled).guilty


def test_the_residual_left_must_be_the_committed_one_and_what_compression_left(honest):
    """A cheater that commits to a forged residual left (to compress its next delta with a poison) is
    caught here; the verifier's chain check holds the next contribution to it."""
    drill, j, result = honest
    state = AuditState.from_bytes(result.audit_state(0))
    forged = {n: t + 1e-2 * t.abs().mean() for n, t in state.residual_out.items()}
    blob = dataclasses.replace(state, residual_out=forged).to_bytes()
    finding = _audit(drill, j, result, 0, blob=blob)  # not the committed residual left
    assert finding.guilty and finding.evidence["binding"] == "residual_out", finding
    committed = result.commitment.model_copy(update={"residual_out": residual_hash(forged)})
    finding = _audit(drill, j, result, 0, blob=blob, commitment=committed)  # committed, but not derived
    assert finding.guilty and finding.evidence["binding"] == "residual_out", finding
    assert "compression left" in finding.reason
    elsewhere = committed.model_copy(update={"device": "cuda:8.0"})
    finding = _audit(drill, j, result, 0, blob=blob, commitment=elsewhere)
    assert finding.guilty and finding.evidence["distance"] > TOLERANCE
    cut = dataclasses.replace(state, residual_out={}).to_bytes()
    finding = _audit(
        drill,
        j,
        result,
        0,
        blob=cut,
        commitment=result.commitment.model_copy(update={"residual_out": residual_hash({})}),
    )
    assert finding.guilty and finding.evidence["binding"] == "residual_out"


def test_an_audit_state_may_hold_only_the_state_its_parameters_optimizer_keeps(honest):
    """AdamW's moments for a matrix Muon steps (or Muon's momentum for one AdamW steps) are refused."""
    drill, j, result = honest
    state = AuditState.from_bytes(result.audit_state(1))
    start = state.segments[0].start
    hidden = "transformer.h.0.mlp.c_fc.weight"
    kept, foreign = (
        ("exp_avg", "momentum_buffer")
        if drill.spec.inner_optimizer == "adamw"
        else ("momentum_buffer", "exp_avg")
    )
    assert f"{kept}.{hidden}" in start
    moved = {**start, f"{foreign}.{hidden}": start[f"{kept}.{hidden}"]}
    blob = dataclasses.replace(
        state, segments=(dataclasses.replace(state.segments[0], start=moved),)
    ).to_bytes()
    trace = [params_hash(moved)[:TRACE_HEX], *result.commitment.trace[1:]]
    finding = _audit(
        drill, j, result, 1, blob=blob, commitment=result.commitment.model_copy(update={"trace": trace})
    )
    assert finding.guilty and f"unexpected tensor '{foreign}.{hidden}'" in finding.reason, finding
