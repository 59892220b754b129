"""What a deployment's replica serves: a training job's LoRA checkpoint is written over the model directory
the job tuned, from the blobs alone, and answers as the tuned model did; an uploaded directory is served as
it was saved."""

from __future__ import annotations

import torch

from gpuflex.agent.server import served_directory
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.serve.model import ServedModel
from gpuflex.testing import save_llama
from gpuflex.train.checkpoint import sha256
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.pretrained import bundle_model
from gpuflex.train.recipes import build_model, get_recipe

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _logits(directory, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ServedModel.load(directory, device="cpu").model(input_ids=ids).logits


def test_a_jobs_lora_checkpoint_is_served_merged_over_the_directory_it_tuned(tmp_path):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50])
    spec = {"recipe": "hf-causal-lm", "model": {"from": str(model_dir)}, "lora": LORA}
    training, bundle, parts = bundle_model(model_dir, TrainingSpec.model_validate(spec), 64 * 1024)
    blobs = {p.sha256: p.read() for p in parts} | {sha256(bundle.to_bytes()): bundle.to_bytes()}
    replica = GlobalReplica(
        build_model(training, get_recipe("hf-causal-lm").from_directory(model_dir)), training
    )
    with torch.no_grad():
        for p in replica.parameters().values():
            p.normal_(0, 0.2)  # adapters that change the answers
    checkpoint = replica.to_bytes()
    blobs[sha256(checkpoint)] = checkpoint
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.no_grad():
        tuned = replica.model.eval()(input_ids=ids).logits
    from_job = DeployedModel(
        job="j-1", checkpoint=sha256(checkpoint), training=training, size=training.model.size
    )
    with served_directory(from_job, blobs.__getitem__, None) as directory:
        assert not (directory / "adapter_config.json").exists()  # merged: a plain model to serve
        torch.testing.assert_close(_logits(directory, ids), tuned, rtol=1e-4, atol=1e-4)
    uploaded = DeployedModel(from_=str(model_dir), uploaded=training.model.uploaded, size=training.model.size)
    with served_directory(uploaded, blobs.__getitem__, None) as directory:
        torch.testing.assert_close(_logits(directory, ids), _logits(model_dir, ids))
        assert not torch.allclose(_logits(directory, ids), tuned, atol=1e-3)
