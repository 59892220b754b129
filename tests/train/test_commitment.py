"""Commitments: traces reproduce bit for bit, stay small, and their audit states round-trip."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import TaskConfig
from gpuflex.train.commitment import (
    TRACE_HEX,
    AuditState,
    RoundTrace,
    Segment,
    params_hash,
    residual_hash,
    trace_every,
    trace_hash,
    training_state,
)
from gpuflex.train.recipes import build_model, get_recipe
from gpuflex.train.worker import Replica

from .helpers import tiny_spec


def _replica(spec, corpus: bytes, index: int = 0) -> Replica:
    config = TaskConfig(
        job_id="j", task_id="w", role="worker", worker_index=index, num_workers=2, training=spec
    )
    recipe = get_recipe("char-gpt")
    return Replica(config, recipe, recipe.build_data(corpus, spec, index, 2))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=16), st.integers(0, 15))
def test_params_hash_is_a_function_of_the_bytes(values, at):
    a = {"w": torch.tensor(values)}
    assert params_hash(a) == params_hash({"w": torch.tensor(values)})
    changed = torch.tensor(values)
    changed[at % len(values)] += 1.0
    assert params_hash({"w": changed}) != params_hash(a)


@settings(max_examples=4, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4))
def test_an_honest_rerun_reproduces_the_trace_bit_for_bit(corpus, label, every):
    spec = tiny_spec(inner_steps=6, verification={"trace_every": every})
    start = {n: p.detach().clone() for n, p in build_model(spec).named_parameters()}
    first, second = (_replica(spec, corpus).train_round(start, label, lambda: False) for _ in range(2))
    assert first.commitment == second.commitment
    assert len(first.commitment.trace) == -(-6 // every)
    assert first.commitment.start == params_hash(start)
    other = _replica(spec, corpus, index=1).train_round(start, label, lambda: False)
    assert other.commitment.data != first.commitment.data and other.commitment.seed != first.commitment.seed


def test_with_muon_the_trace_covers_the_hidden_matrices_momentum_and_the_others_adamw_moments(corpus):
    spec = tiny_spec(inner_steps=2, inner_optimizer="muon")
    replica = _replica(spec, corpus)
    start = {n: p.detach().clone() for n, p in replica.model.named_parameters()}
    first = replica.train_round(start, 0, lambda: False)
    state = training_state(replica.model, replica.optimizer)
    momentum = {k.removeprefix("momentum_buffer.") for k in state if k.startswith("momentum_buffer.")}
    assert momentum == {
        f"transformer.h.0.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert not any(f"exp_avg.{name}" in state for name in momentum)
    assert "exp_avg.transformer.wte.weight" in state and "exp_avg_sq.transformer.h.0.ln_1.bias" in state
    assert params_hash(state)[:TRACE_HEX] == first.commitment.trace[-1]
    name = next(iter(momentum))
    replica.optimizer.state[dict(replica.model.named_parameters())[name]]["momentum_buffer"][0, 0] += 1e-3
    assert trace_hash(replica.model, replica.optimizer) != first.commitment.trace[-1]


def test_a_commitment_of_32_segments_fits_in_a_kilobyte(corpus):
    spec = tiny_spec(inner_steps=32, verification={"trace_every": 1})
    start = {n: p.detach().clone() for n, p in build_model(spec).named_parameters()}
    replica = _replica(spec, corpus)
    _, result = replica.seal(replica.train_round(start, 0, lambda: False))
    assert len(result.commitment.trace) == 32 and result.commitment.residual is not None
    assert len(result.commitment.model_dump_json()) <= 1024
    assert len(result.trace.lrs) == 32 and set(result.trace.kept) == set(range(33))  # tiny: every state kept


def test_trace_every_defaults_to_an_eighth_and_never_exceeds_64_hashes():
    assert trace_every(tiny_spec(inner_steps=80)) == 10
    assert trace_every(tiny_spec(inner_steps=3)) == 1
    assert trace_every(tiny_spec(inner_steps=1000, verification={"trace_every": 1})) == 16


def test_an_audit_state_round_trips_and_a_foreign_blob_is_refused():
    state = {"p.w": torch.arange(4.0), "exp_avg.w": torch.ones(4)}
    segment = Segment(3, state, {"p.w": torch.zeros(4)}, [0.1, 0.2])
    blob = AuditState((segment,), {"w": torch.ones(4)}, {}, {}, {"w": torch.full((4,), 2.0)}).to_bytes()
    back = AuditState.from_bytes(blob)
    (seg,) = back.segments
    assert seg.step == 3 and seg.lrs == [0.1, 0.2] and back.segment(3) is seg and back.segment(0) is None
    torch.testing.assert_close(seg.start["p.w"], state["p.w"])
    torch.testing.assert_close(back.residual["w"], torch.ones(4))
    torch.testing.assert_close(back.residual_out["w"], torch.full((4,), 2.0))
    with pytest.raises(BadRequest):
        AuditState.from_bytes(b"not safetensors")


def test_an_audit_state_of_several_segments_holds_each_boundary_once_and_steps_on():
    states = [{"p.w": torch.full((2,), float(i))} for i in range(4)]
    trace = RoundTrace(2, ([0.0, 0.2], [0.1, 0.2], [0.2, 0.2]), dict(enumerate(states)))
    answer = trace.answer(1, 5, {}, {})  # clipped at the trace's end
    back = AuditState.from_bytes(answer.to_bytes())
    assert [s.step for s in back.segments] == [2, 4] and back.segment(4).lrs == [0.2, 0.2]
    torch.testing.assert_close(back.segment(4).start["p.w"], states[2]["p.w"])
    torch.testing.assert_close(back.final_state()["p.w"], states[3]["p.w"])  # the last segment's end
    torch.testing.assert_close(back.origin_params()["w"], states[0]["p.w"])
    assert trace.answer(3, 1, {}, {}) is None


def test_a_trace_re_derives_the_states_it_did_not_keep_from_the_nearest_it_kept():
    states = [{"p.w": torch.full((2,), float(i))} for i in range(5)]
    calls = []

    def rerun(boundary, state, until):
        calls.append((boundary, until))
        return [states[b] for b in range(boundary + 1, until + 1)], states[4]

    trace = RoundTrace(1, ([0.1],) * 4, {0: states[0], 2: states[2]}, rerun)
    back = trace.answer(3, 1, {}, {})
    assert calls == [(2, 3)] and [s.step for s in back.segments] == [3]  # from boundary 2, not the start
    torch.testing.assert_close(back.segments[0].start["p.w"], states[3]["p.w"])
    torch.testing.assert_close(back.final_state()["p.w"], states[4]["p.w"])  # the live final state
    trace.answer(0, 1, {}, {})
    assert calls[-1] == (0, 1)


def test_sealing_commits_to_the_residual_compressed_with_and_audit_states_skip_what_they_hold(corpus):
    spec = tiny_spec(inner_steps=3, verification={"trace_every": 1}, compression={"method": "topk"})
    start = {n: p.detach().clone() for n, p in build_model(spec).named_parameters()}
    replica = _replica(spec, corpus)
    _, first = replica.seal(replica.train_round(start, 0, lambda: False))
    assert first.commitment.residual == residual_hash({}) and first.residual == {}
    assert 0 < first.trace_s < first.compute_s  # tracing is timed apart, within the round's compute
    owed = replica.feedback.residual
    assert first.residual_out is owed and first.commitment.residual_out == residual_hash(owed)
    _, second = replica.seal(replica.train_round(start, 1, lambda: False))
    assert second.residual is owed and second.commitment.residual == residual_hash(owed) != residual_hash({})
    assert second.commitment.residual_out == residual_hash(replica.feedback.residual) != residual_hash(owed)
    final = second.trace.kept[3]
    for index in range(3):
        state = AuditState.from_bytes(second.audit_state(index))
        assert params_hash(state.final_state()) == params_hash(final)
        assert params_hash(state.origin_params()) == second.commitment.start == params_hash(start)
        assert (state.final == {}) == (index == 2) and (state.origin == {}) == (index == 0)
        assert params_hash(state.residual) == params_hash(owed)
    assert second.audit_state(3) is None


@pytest.mark.parametrize("skip", [range(0), range(2, 4)])
def test_a_worker_that_kept_only_the_start_answers_every_audit_as_one_that_kept_all(
    corpus, monkeypatch, skip
):
    """Re-deriving a segment's start by re-running the steps before it gives the very bytes a worker that
    kept every boundary uploads (a shirker's skipped steps skipped again), and the worker's model and
    optimizer are left as they were: its next round is the same."""
    spec = tiny_spec(inner_steps=6, verification={"trace_every": 2})
    start = {n: p.detach().clone() for n, p in build_model(spec).named_parameters()}
    keeper, rerunner = _replica(spec, corpus), _replica(spec, corpus)
    monkeypatch.setattr("gpuflex.market.memory.SNAPSHOT_BUDGET", 0)
    assert keeper.snapshot_stride() == 4 and rerunner.snapshot_stride() == 4  # the start alone: stride > 3
    monkeypatch.undo()
    kept = keeper.seal(keeper.train_round(start, 0, lambda: False, skip=skip))[1]
    monkeypatch.setattr("gpuflex.market.memory.SNAPSHOT_BUDGET", 0)
    rerun = rerunner.seal(rerunner.train_round(start, 0, lambda: False, skip=skip))[1]
    assert set(kept.trace.kept) == {0, 1, 2, 3} and set(rerun.trace.kept) == {0}
    assert rerun.commitment == kept.commitment
    live = params_hash(training_state(rerunner.model, rerunner.optimizer))
    for segment in range(3):
        for count in (1, 2):
            assert rerun.audit_state(segment, count) == kept.audit_state(segment, count)
    assert params_hash(training_state(rerunner.model, rerunner.optimizer)) == live
    assert (
        rerunner.train_round(start, 1, lambda: False).commitment
        == keeper.train_round(start, 1, lambda: False).commitment
    )
