"""Where a worker's tensors live: the frozen base once in the steps' dtype or quantized, the outer state in
host memory, 8-bit optimizer states; and that audits still re-run every layout bit for bit."""

from __future__ import annotations

from pathlib import Path

import bitsandbytes
import pytest
import torch
import torch.nn.functional as F

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import TaskConfig
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.commitment import training_state
from gpuflex.train.lm_loss import chunked_cross_entropy
from gpuflex.train.placement import frozen_dtype, snapshot_stride
from gpuflex.train.recipes import get_recipe
from gpuflex.train.worker import Replica

from .helpers import audited_round, llama_dir, llama_training

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory, hidden=64)  # bitsandbytes quantizes in blocks of 64 values


def spec_for(model_dir: Path, **fields) -> TrainingSpec:
    return llama_training(model_dir, **{"verification": {"trace_every": 1}, **fields})


def _replica(model_dir: Path, spec: TrainingSpec) -> tuple[Replica, list]:
    recipe = get_recipe("hf-causal-lm").from_directory(model_dir, CPU)
    corpus = (model_dir / "tokenizer.json").read_bytes() * 4
    data = [recipe.build_data(corpus, spec, i, 2) for i in range(2)]
    config = TaskConfig(job_id="j", task_id="w0", role="worker", worker_index=0, num_workers=2, training=spec)
    return Replica(config, recipe, data[0]), data


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_lora_base_is_held_once_in_the_steps_dtype_and_the_replica_only_in_host_memory(
    model_dir, precision, dtype
):
    spec = spec_for(model_dir, lora=LORA, precision=precision)
    replica, _ = _replica(model_dir, spec)
    frozen = [p for p in replica.model.parameters() if not p.requires_grad]
    trained = [p for p in replica.model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {dtype} and {p.dtype for p in trained} == {torch.float32}
    assert frozen_dtype(spec, CPU) == dtype
    # the global replica: a copy of the adapters alone, not a second model, and none of the model's tensors
    held = replica.global_.parameters()
    assert held.keys() == {n for n, p in replica.model.named_parameters() if p.requires_grad}
    assert not {t.data_ptr() for t in held.values()} & {p.data_ptr() for p in replica.model.parameters()}
    assert not hasattr(replica.global_, "model")
    full, _ = _replica(model_dir, spec_for(model_dir, precision=precision))
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}  # trained weights: fp32 masters


def test_fp16_steps_on_a_cpu_hold_the_base_in_fp32_as_they_compute():
    spec = TrainingSpec(recipe="hf-causal-lm", precision="fp16", lora=LORA)
    assert frozen_dtype(spec, CPU) == torch.float32
    assert frozen_dtype(spec, torch.device("cuda")) == torch.float16


@pytest.mark.parametrize(("quantized", "layer"), [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_a_quantized_base_trains_adapters_and_an_audit_re_runs_it_bit_for_bit(model_dir, quantized, layer):
    spec = spec_for(model_dir, lora=LORA, precision="bf16", quantize_base=quantized)
    replica, data = _replica(model_dir, spec)
    q_proj = replica.model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == layer
    assert all(p.dtype == torch.float32 for p in replica.global_.parameters().values())
    result, finding = audited_round(replica, data, 2)
    assert result.commitment.device == f"cpu/{torch.get_num_threads()}t/bf16/{quantized}"
    assert not finding.guilty, finding.reason
    assert "bit for bit" in finding.reason


def test_8bit_optimizer_states_are_traced_and_an_audit_re_runs_them_bit_for_bit(model_dir):
    spec = spec_for(model_dir, optimizer_states="8bit")
    replica, data = _replica(model_dir, spec)
    assert all(type(part).__name__ == "AdamW8bit" for part in replica.optimizer.parts)
    _, finding = audited_round(replica, data, 1)
    state = training_state(replica.model, replica.optimizer)
    assert any(k.startswith("state1.") and v.dtype == torch.uint8 for k, v in state.items())
    assert not finding.guilty, finding.reason
    assert "bit for bit" in finding.reason


def test_quantize_base_without_lora_and_shard_on_one_device_are_refused_by_the_spec():
    with pytest.raises(ValueError, match="quantize_base nf4 quantizes a frozen base: it needs lora"):
        TrainingSpec(recipe="hf-causal-lm", quantize_base="nf4")
    with pytest.raises(ValueError, match="shard spreads a model over a node's devices"):
        TrainingSpec(recipe="hf-causal-lm", shard=True)
    with pytest.raises(ValueError, match="optimizer_states 8bit is AdamW's"):
        TrainingSpec(inner_optimizer="muon", optimizer_states="8bit")


def test_a_node_without_bitsandbytes_says_so_in_one_line(model_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)
    spec = spec_for(model_dir, lora=LORA, quantize_base="nf4")
    with pytest.raises(BadRequest, match="quantize_base nf4 needs bitsandbytes on this node"):
        _replica(model_dir, spec)
    with pytest.raises(BadRequest, match="optimizer_states 8bit needs bitsandbytes on this node"):
        _replica(model_dir, spec_for(model_dir, optimizer_states="8bit"))
    assert bitsandbytes  # imported above: the module itself is fine


def test_trace_snapshots_are_kept_within_the_budget():
    assert snapshot_stride(100, 8, budget=900) == 1  # all 9 boundaries fit
    assert snapshot_stride(100, 8, budget=300) == 3  # every third
    assert snapshot_stride(100, 8, budget=50) == 9  # the start alone
    assert snapshot_stride(100, 8, budget=0) == 9


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_loss_is_the_cross_entropy_of_the_whole_logits(bias, autocast):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    results = []
    for chunked in (False, True):
        head.zero_grad()
        hidden.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            if chunked:
                loss = chunked_cross_entropy(hidden, head, targets, chunk=5)
            else:
                loss = F.cross_entropy(head(hidden).float().reshape(-1, 50), targets.reshape(-1))
        (2 * loss).backward()
        results.append((loss.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    (plain, plain_h, plain_w), (chunk, chunk_h, chunk_w) = results
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(chunk, plain, **tolerance)
    torch.testing.assert_close(chunk_h, plain_h, **tolerance)
    torch.testing.assert_close(chunk_w, plain_w, **tolerance)
