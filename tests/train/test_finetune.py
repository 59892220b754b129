"""Fine-tuning a model directory: sized and checked at submit, LoRA's trainable-only exchange, precision
and micro-batches in the inner step, audits that re-run a bf16 LoRA segment bit for bit, and export."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers

from gpuflex.data.cache import ShardCache
from gpuflex.errors import BadRequest, HashMismatch
from gpuflex.protocol.messages import TaskConfig
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.storage.fetching import FETCH_WORKERS
from gpuflex.testing import CountingBlobs, save_llama
from gpuflex.train.checkpoint import sha256
from gpuflex.train.export import export_hf, whole_model
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.precision import InnerStep
from gpuflex.train.pretrained import bundle_model, describe, model_directory
from gpuflex.train.recipes import build_model, get_recipe
from gpuflex.train.worker import Replica, step

from .helpers import audited_round, llama_dir, llama_training

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory)


def spec_for(model_dir: Path, **fields) -> TrainingSpec:
    return llama_training(model_dir, **{"inner_steps": 8, "batch_size": 8, **fields})


def test_a_model_directory_is_sized_on_the_meta_device_with_its_lora(model_dir):
    full = describe(model_dir, spec_for(model_dir))
    lora = describe(model_dir, spec_for(model_dir, lora=LORA))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert full.parameters == full.trainable == sum(p.numel() for p in model.parameters())
    assert (full.layers, full.hidden) == (2, 32)
    # q_proj and v_proj of 2 layers, each A (4 x 32) and B (32 x 4)
    assert lora.trainable == 2 * 2 * (4 * 32 + 32 * 4)


class Hub(CountingBlobs):
    """A model directory's blobs as the coordinator serves them, counting fetches."""

    PART_BYTES = 64 * 1024  # the weights (about 210 kB) are several parts

    def __init__(self, model_dir: Path):
        self.spec, self.bundle, parts = bundle_model(model_dir, spec_for(model_dir), self.PART_BYTES)
        bundle = self.bundle.to_bytes()
        super().__init__({p.sha256: p.read() for p in parts} | {sha256(bundle): bundle})


def test_a_nodes_tasks_fetch_a_model_directory_once_through_its_cache(model_dir, tmp_path):
    hub, cache = Hub(model_dir), ShardCache(tmp_path / "cache", limit_bytes=1 << 20)
    weights = hub.bundle.file("model.safetensors")
    assert len(weights.parts) > 1
    with model_directory(hub.spec, hub.fetch, cache) as first:
        assert (first / "model.safetensors").resolve() == cache.get(weights.sha256)  # linked, not copied
        transformers.AutoModelForCausalLM.from_pretrained(first)
    assert sorted(hub.fetched) == sorted(hub.blobs)  # every blob once
    assert cache.get(weights.parts[0].sha256) is None  # the whole file is cached by its hash, not its parts
    hub.fetched.clear()
    with model_directory(hub.spec, hub.fetch, cache) as second:  # the next task on this node
        for f in hub.bundle.files:
            assert (second / f.name).read_bytes() == (model_dir / f.name).read_bytes()
    assert hub.fetched == []  # nothing fetched
    assert not first.exists() and cache.get(weights.sha256)  # the task's links go, the cache keeps the files


def test_a_spoilt_cached_model_file_is_fetched_again_and_a_twice_corrupted_one_fails_naming_it(
    model_dir, tmp_path
):
    hub, cache = Hub(model_dir), ShardCache(tmp_path / "cache", limit_bytes=1 << 20)
    weights = hub.bundle.file("model.safetensors")
    with model_directory(hub.spec, hub.fetch, cache):
        pass
    spoilt = cache.get(weights.sha256)
    spoilt.write_bytes(b"\0" * weights.size)  # another task, or the disk, spoilt it
    hub.fetched.clear()
    hub.bad = 1  # and the first fetch of its first part arrives corrupted too
    with model_directory(hub.spec, hub.fetch, cache) as directory:
        assert (directory / "model.safetensors").read_bytes() == (
            model_dir / "model.safetensors"
        ).read_bytes()
    # the file is fetched again whole; of the spoilt try, only the parts in flight (FETCH_WORKERS at once)
    # and the corrupted one came before it stopped
    fetched = Counter(hub.fetched)
    assert set(fetched) == {p.sha256 for p in weights.parts} and max(fetched.values()) == 2
    assert len(hub.fetched) <= len(weights.parts) + FETCH_WORKERS
    cache.drop(weights.sha256)
    hub.bad = 2 * len(weights.parts)  # every fetch of both tries arrives corrupted
    with (
        pytest.raises(
            HashMismatch, match=f"model file model.safetensors arrived corrupted 2 times .*{weights.sha256}"
        ),
        model_directory(hub.spec, hub.fetch, cache),
    ):
        pass


def test_a_model_file_larger_than_the_cache_is_written_into_the_task_directory(model_dir, tmp_path):
    hub = Hub(model_dir)
    weights = hub.bundle.file("model.safetensors")
    cache = ShardCache(tmp_path / "cache", limit_bytes=weights.size - 1)
    with model_directory(hub.spec, hub.fetch, cache) as directory:
        assert not (directory / "model.safetensors").is_symlink()
        assert (directory / "config.json").is_symlink()
        transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert cache.get(weights.sha256) is None


def test_bad_model_directories_are_one_line_naming_what_is_wrong(model_dir, tmp_path):
    def broken(*drop: str, **write: str) -> Path:
        root = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dir, root)
        for name in drop:
            (root / name).unlink()
        for name, text in write.items():
            (root / name.replace("_", ".")).write_text(text)
        return root

    cases = [
        (broken("config.json"), "has no config.json"),
        (broken("model.safetensors", pytorch_model_bin="x"), "a .bin is a pickle"),
        (broken(config_json=json.dumps({"model_type": "nosuchmodel"})), "nosuchmodel"),
        (broken(config_json=json.dumps({"model_type": "vit"})), "cannot build"),
    ]
    for root, expected in cases:
        with pytest.raises(BadRequest, match=expected) as caught:
            describe(root, spec_for(root))
        assert "\n" not in caught.value.message
    bad_target = spec_for(model_dir, lora={**LORA, "target_modules": ["q_proj", "qkv"]})
    with pytest.raises(BadRequest, match="qkv matches no module of the model; its modules: down_proj"):
        describe(model_dir, bad_target)


def test_lora_exchanges_and_checkpoints_only_the_adapters(model_dir):
    spec = spec_for(model_dir, lora=LORA)
    recipe = get_recipe("hf-causal-lm").from_directory(model_dir)
    replica = GlobalReplica(build_model(spec, recipe), spec)
    assert replica.parameters() and all(".lora_" in n for n in replica.parameters())
    checkpoint = replica.to_bytes()
    assert len(checkpoint) < (model_dir / "model.safetensors").stat().st_size / 10
    with torch.no_grad():
        for p in replica.parameters().values():
            p.add_(0.5)
    other = GlobalReplica(build_model(spec, recipe), spec)
    other.load(replica.to_bytes())
    assert other.state_hash() == replica.state_hash()
    whole = build_model(spec_for(model_dir), recipe)
    full = GlobalReplica(whole, spec_for(model_dir))
    assert full.parameters().keys() == dict(whole.named_parameters()).keys()


def test_micro_batches_add_up_to_the_batch_and_fp16_on_a_cpu_falls_back_to_fp32(model_dir):
    spec = spec_for(model_dir)
    recipe = get_recipe("hf-causal-lm").from_directory(model_dir)
    corpus = (model_dir / "tokenizer.json").read_bytes() * 4
    batch = recipe.build_data(corpus, spec, 0, 1).sample(torch.Generator().manual_seed(0))
    grads = []
    for micro in (None, 2):
        model = build_model(spec, recipe)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = step(recipe, model, model, optimizer, batch, inner=InnerStep("cpu", None, micro))
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)
    assert InnerStep.for_spec(spec_for(model_dir, precision="fp16"), torch.device("cpu")).label == "fp32"


def test_an_audit_re_runs_a_bf16_lora_segment_bit_for_bit_in_its_hardware_class(model_dir, corpus):
    spec = spec_for(model_dir, lora=LORA, precision="bf16", micro_batch_size=4, rounds=1)
    recipe = get_recipe("hf-causal-lm").from_directory(model_dir)
    data = [recipe.build_data(corpus, spec, i, 2) for i in range(2)]
    config = TaskConfig(job_id="j", task_id="w0", role="worker", worker_index=0, num_workers=2, training=spec)
    result, finding = audited_round(Replica(config, recipe, data[0]), data, 5)
    assert result.commitment.device == f"cpu/{torch.get_num_threads()}t/bf16"
    assert not finding.guilty, finding.reason
    assert "bit for bit" in finding.reason


@pytest.mark.parametrize("merge", [False, True])
def test_a_lora_checkpoint_exports_as_a_directory_transformers_loads(model_dir, tmp_path, merge):
    import peft

    spec = spec_for(model_dir, lora=LORA, gradient_checkpointing=True)
    recipe = get_recipe("hf-causal-lm").from_directory(model_dir)
    tuned = build_model(spec, recipe)
    replica = GlobalReplica(tuned, spec)
    with torch.no_grad():
        for p in replica.parameters().values():
            p.normal_(0, 0.2)
    replica.write_to(tuned)
    tuned.eval()
    out = export_hf(replica.to_bytes(), spec, model_dir, tmp_path / "out", merge=merge)
    assert (out / "tokenizer.json").is_file()
    assert (out / "adapter_config.json").is_file() != merge
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    if not merge:
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        assert isinstance(peft.PeftModel.from_pretrained(base, out), peft.PeftModel)
    ids = transformers.AutoTokenizer.from_pretrained(out)("alpha beta", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tuned(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert loaded.generate(ids, max_new_tokens=4, do_sample=False).shape[-1] == ids.shape[-1] + 4


def test_an_adapter_becomes_a_whole_model_over_the_base_it_names_or_a_line_saying_what_works(
    model_dir, tmp_path
):
    spec = spec_for(model_dir, lora=LORA)
    replica = GlobalReplica(build_model(spec, get_recipe("hf-causal-lm").from_directory(model_dir)), spec)
    with torch.no_grad():
        for p in replica.parameters().values():
            p.normal_(0, 0.2)
    adapter = export_hf(replica.to_bytes(), spec, model_dir, tmp_path / "tuned")
    merged = export_hf(replica.to_bytes(), spec, model_dir, tmp_path / "merged", merge=True)
    with whole_model(merged) as directory:
        assert directory == merged  # a whole model is itself
    with whole_model(adapter) as directory:
        assert directory.name == "tuned"
        assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in merged.iterdir())
        weights = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
        expected = transformers.AutoModelForCausalLM.from_pretrained(merged).state_dict()
        torch.testing.assert_close(weights, expected)
    assert not directory.exists()

    moved = shutil.copytree(adapter, tmp_path / "elsewhere")
    config = json.loads((moved / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve())
    gone = tmp_path / "gone"
    config["base_model_name_or_path"] = str(gone)
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(BadRequest) as refused, whole_model(moved):
        pass
    assert refused.value.message == (
        f"{moved} is a LoRA adapter over {gone}, which is not a model directory on this machine: "
        "fetch its job as a whole model (gpuflex job fetch JOB --format hf --merge -o DIR), "
        "or deploy the job (gpuflex deploy JOB)"
    )

    other = save_llama(tmp_path / "wider", ["alpha beta gamma delta " * 64], hidden=64)
    config["base_model_name_or_path"] = str(other)
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(BadRequest) as refused, whole_model(moved):
        pass
    assert refused.value.message.startswith(f"{moved} is a LoRA adapter that does not fit its base {other}: ")
    assert "size mismatch" in refused.value.message and "\n" not in refused.value.message


def test_export_refuses_what_it_cannot_write(model_dir, tmp_path):
    spec = spec_for(model_dir)
    checkpoint = GlobalReplica(build_model(spec, get_recipe("hf-causal-lm").from_directory(model_dir)), spec)
    with pytest.raises(BadRequest, match="--merge merges LoRA adapters"):
        export_hf(checkpoint.to_bytes(), spec, model_dir, tmp_path / "out", merge=True)
