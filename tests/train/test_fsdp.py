"""A replica sharded over two local ranks with FSDP2 (``training.shard``; gloo on CPU here): it trains the
DDP replica's round, rank 0 commits to whole states, an audit re-runs it, and the market counts what a
rank holds."""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from gpuflex.errors import SpecError
from gpuflex.market.memory import worker_memory
from gpuflex.protocol.messages import Contribution, TaskConfig
from gpuflex.protocol.spec import TrainingSpec, parse_job_spec
from gpuflex.train.checkpoint import sha256
from gpuflex.train.commitment import TRACE_HEX, params_hash
from gpuflex.train.device_group import DataParallel, DeviceGroup
from gpuflex.train.pretrained import sized
from gpuflex.train.recipes import for_task
from gpuflex.train.sharding import Sharded
from gpuflex.train.trainable import trainable
from gpuflex.train.transport import LocalTransport
from gpuflex.train.verifier import Verifier
from gpuflex.train.worker import Replica, RoundResult, _follow

from .helpers import ThreadedJob, llama_dir, llama_training, task_config, tiny_spec

TIMEOUT = 120
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
TWO_RANKS = {"local_devices": 2, "shard": True, "verification": {"trace_every": 2}}


@dataclass
class Round:
    """One round of a replica over two ranks, as its rank 0 (this process) saw it."""

    replica: Replica
    result: RoundResult
    start: dict[str, torch.Tensor]
    config: TaskConfig
    held: dict[str, int]  # bytes of this rank's trained weights, gradients, optimizer moments, frozen weights


def _held(replica: Replica) -> dict[str, int]:
    """Bytes of what this rank holds of the model state (its shards, when sharded)."""

    def nbytes(tensors) -> int:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)

    trained = list(trainable(replica.model).values())
    moments = [v for p in trained for k, v in replica.optimizer.state[p].items() if k != "step"]
    frozen = [p for p in replica.model.parameters() if not p.requires_grad]
    grads = [p.grad for p in trained]
    return {
        "trained": nbytes(trained),
        "gradients": nbytes(grads),
        "optimizer": nbytes(moments),
        "frozen": nbytes(frozen),
    }


def _round(
    spec: TrainingSpec, corpus: bytes, kind: type[DeviceGroup], model_dir: Path | None = None, follow=_follow
) -> Round:
    """Train round 0 from the spec's initial weights on a replica of two ranks (this process and a child)
    that split the work as ``kind`` does, whatever the spec's ``shard``."""
    digest = sha256(corpus)
    config = task_config(spec, digest, "worker", 0, num_workers=1)
    blobs = {digest: corpus}
    recipe, data = for_task(config, blobs.__getitem__, model_dir=model_dir)
    held: dict[str, int] = {}

    def measure(_seconds: float) -> None:  # after the first step: its gradients and moments exist
        if not held:
            held.update(_held(replica))

    group = kind.start(config, blobs, model_dir, follow)
    try:
        replica = Replica(config, recipe, data, group, after_step=measure)
        start = {n: t.clone() for n, t in replica.global_params().items()}
        result = replica.train_round(replica.global_params(), 0, lambda: False)
    finally:
        group.close()
    return Round(replica, result, start, config, held)


def _follow_other_batches(group, config, blobs, model_dir) -> None:
    """A cheating rank 1: it trains on batches of another seed than the one its replica's commitment names."""
    other = config.training.model_copy(update={"seed": config.training.seed + 1})
    _follow(group, config.model_copy(update={"training": other}), blobs, model_dir)


def _distance(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[k].double() - reference[k].double()).pow(2).sum()) for k in reference)
    return math.sqrt(num / sum(float(reference[k].double().pow(2).sum()) for k in reference))


def _audit(run: Round, segment: int):
    """Seal the round, screen it and have a verifier (one CPU process) audit ``segment``."""
    replica = run.replica
    blob, result = replica.seal(run.result)
    contribution = Contribution(
        task_id="worker-0",
        node_id="n0",
        delta=sha256(blob),
        tokens=result.steps * replica.tokens_per_step,
        steps=result.steps,
        train_loss=result.train_loss,
        commitment=result.commitment,
        audit_segment=segment,
    )
    verifier = Verifier(replica.spec, replica.recipe, lambda worker: replica.data, 1)
    state_hash = replica.global_.state_hash()
    (judged,) = verifier.screen(0, run.start, state_hash, [(contribution, replica.decode(blob))])
    assert not judged.guilty, judged.verdict
    return verifier.audit(0, judged, result.audit_state(segment))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory)


def llama_spec(model_dir: Path, **fields) -> TrainingSpec:
    return sized(llama_training(model_dir, **{**TWO_RANKS, **fields}))


@pytest.fixture(scope="module")
def char_spec() -> TrainingSpec:
    return tiny_spec(rounds=2, inner_steps=6, **TWO_RANKS)


@pytest.fixture(scope="module")
def sharded(char_spec, corpus) -> Round:
    return _round(char_spec, corpus, Sharded)


@pytest.fixture(scope="module")
def sharded_lora(model_dir, corpus) -> Round:
    return _round(llama_spec(model_dir, lora=LORA), corpus, Sharded, model_dir)


def _trains_the_ddp_round(run: Round, ddp: Round) -> None:
    assert run.result.commitment.device == f"cpu/{torch.get_num_threads()}t/fsdp2"
    assert ddp.result.commitment.device.endswith("/ddp2")
    assert run.result.steps == ddp.result.steps and run.result.train_loss == pytest.approx(
        ddp.result.train_loss
    )
    # the same round, summed in another order: its delta, and the final weights and AdamW moments
    assert _distance(run.result.delta, ddp.result.delta) < 1e-4
    final = len(run.result.commitment.trace)
    assert _distance(run.result.trace.kept[final], ddp.result.trace.kept[final]) < 1e-5
    params = trainable(run.replica.model).values()
    assert all(isinstance(p, DTensor) for p in params)
    local, whole = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
    assert 0.5 <= local / whole < 0.52  # rank 0's rows: half of every tensor, rounded up


def test_a_sharded_char_gpt_replica_trains_the_ddp_replicas_round_holding_half_of_it(
    sharded, char_spec, corpus
):
    _trains_the_ddp_round(
        sharded, _round(char_spec.model_copy(update={"shard": False}), corpus, DataParallel)
    )


def test_a_sharded_llama_from_a_model_directory_trains_the_ddp_replicas_round(model_dir, corpus):
    """The follower rank builds the model from the directory rank 0 wrote out. (A job takes a model
    directory over several ranks only sharded; DDP's round of it is the reference here.)"""
    spec = llama_spec(model_dir)
    _trains_the_ddp_round(
        _round(spec, corpus, Sharded, model_dir), _round(spec, corpus, DataParallel, model_dir)
    )


def test_rank_0_keeps_whole_states_that_hash_to_its_trace(sharded):
    result, shapes = sharded.result, {n: p.shape for n, p in sharded.start.items()}
    trace, kept = result.commitment.trace, result.trace.kept
    assert sorted(kept) == list(range(len(trace) + 1))  # every boundary: a re-run would need both ranks
    whole = {f"{kind}.{n}": shape for n, shape in shapes.items() for kind in ("p", "exp_avg", "exp_avg_sq")}
    assert {k: t.shape for k, t in kept[0].items()} == {k: s for k, s in whole.items() if k.startswith("p.")}
    for boundary, hashed in enumerate(trace, start=1):  # the round's first step made the moments
        state = kept[boundary]
        assert {k: t.shape for k, t in state.items() if not k.startswith("step.")} == whole
        assert not any(isinstance(t, DTensor) for t in state.values())
        assert params_hash(state)[:TRACE_HEX] == hashed
    final = kept[len(trace)]
    assert all(torch.allclose(sharded.start[n] - result.delta[n], final[f"p.{n}"]) for n in shapes)


def test_an_audit_passes_a_sharded_replica_and_catches_a_rank_on_other_batches(sharded, char_spec, corpus):
    honest = _audit(sharded, segment=1)
    assert not honest.guilty and "within tolerance" in honest.reason, honest.reason
    assert honest.evidence["distance"] < 1e-4
    cheat = _audit(_round(char_spec, corpus, Sharded, follow=_follow_other_batches), segment=1)
    assert cheat.guilty and "too far" in cheat.reason, cheat.reason


def test_a_sharded_lora_replica_trains_its_adapters_and_passes_an_audit(sharded_lora):
    base = sharded_lora.replica.model.get_base_model()
    assert isinstance(base.model.embed_tokens.weight, DTensor)  # the frozen base is sharded too
    assert set(sharded_lora.result.delta) == set(sharded_lora.start) and all(
        "lora_" in n for n in sharded_lora.start
    )
    finding = _audit(sharded_lora, segment=1)
    assert not finding.guilty and "within tolerance" in finding.reason, finding.reason


def test_a_sharded_qlora_replica_shards_its_4bit_base_and_passes_an_audit_of_one_process(model_dir, corpus):
    """bitsandbytes' NF4 weights, packed in bf16 elements, are sharded and gathered as any weight; an
    auditor re-runs the segment with the whole quantized model in one process, within tolerance."""
    spec = llama_spec(model_dir, lora=LORA, quantize_base="nf4", precision="bf16")
    run = _round(spec, corpus, Sharded, model_dir)
    q_proj = run.replica.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(q_proj).__name__ == "Linear4bit" and isinstance(q_proj.weight, DTensor)
    assert run.result.commitment.device == f"cpu/{torch.get_num_threads()}t/bf16/nf4/fsdp2"
    finding = _audit(run, segment=1)
    assert not finding.guilty and "within tolerance" in finding.reason, finding.reason


@pytest.mark.parametrize("run", ["sharded", "sharded_lora"])
def test_the_market_counts_what_a_rank_holds(run, request):
    """``worker_memory``'s per-device model state is rank 0's shards: weights, gradients, moments and the
    frozen base (the two ranks' rows differ by at most one row of each tensor)."""
    measured = request.getfixturevalue(run)
    estimate = worker_memory(measured.config.training)
    for part in ("trained", "gradients", "optimizer", "frozen"):
        assert measured.held[part] == pytest.approx(getattr(estimate, part), rel=0.02, abs=64), part


def test_a_sharded_worker_completes_its_rounds_and_its_audits_re_run_both_ranks(corpus):
    spec = tiny_spec(
        rounds=2, local_devices=2, shard=True, verification={"audit_rate": 1.0, "trace_every": 4}
    )
    transport = LocalTransport(2, live_workers=1, audit_rate=1.0)
    with ThreadedJob(transport, spec, transport.put_blob(corpus), num_workers=1) as job:
        worker = job.start("worker", 0)
        assert job.start("aggregator").result(timeout=TIMEOUT)["finished"]
        summary = worker.result(timeout=TIMEOUT)
    assert summary["finished"] and summary["contributed"] == [0, 1]
    assert summary["tokens"] == 2 * 2 * spec.inner_steps * spec.batch_size * spec.model.block_size
    audits = [v for v in transport.verdicts() if v.check == "audit"]
    assert len(audits) == 2 and not any(v.guilty for v in transport.verdicts()), transport.verdicts()
    assert all("within tolerance" in v.reason and v.evidence["distance"] < 1e-4 for v in audits)
    assert transport.history()[-1].val_loss < transport.history()[0].val_loss
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"lora": LORA, "quantize_base": "int8"}, "FSDP2 shards bitsandbytes' 4-bit weights"),
        ({"inner_optimizer": "muon"}, "AdamW in fp32 states"),
        ({"optimizer_states": "8bit"}, "AdamW in fp32 states"),
        ({"shard": False}, "model.from combines with local_devices > 1 only sharded"),
    ],
)
def test_what_shard_does_not_combine_with_is_refused_in_one_line(fields, refusal):
    training = {
        "recipe": "hf-causal-lm",
        "model": {"from": "./m"},
        "local_devices": 2,
        "shard": True,
        **fields,
    }
    with pytest.raises(SpecError, match=refusal):
        parse_job_spec({"name": "x", "training": training})
