"""Jobs on a model directory: uploaded as blobs in parts under the store's limit, checked again on the
server before any money moves, and sized for the market's VRAM estimate."""

from __future__ import annotations

import pytest

from gpuflex.cli.jobs import upload_model
from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import JobSpec, UploadedModel
from gpuflex.storage.bundles import Bundle
from gpuflex.testing import save_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("model") / "m", ["alpha beta gamma delta. " * 50], hidden=64)


def job(model_dir, **model) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "tune",
            "training": {
                "recipe": "hf-causal-lm",
                "model": {"from": str(model_dir), **model},
                "lora": {"r": 4},
                "precision": "bf16",
            },
            "budget": 1.0,
        }
    )


def test_a_model_directory_goes_up_in_parts_once_and_the_job_names_it(coordinator, model_dir):
    alice = coordinator.consumer("alice", deposit=5)
    spec = upload_model(alice, job(model_dir))
    uploaded = spec.training.model.uploaded
    assert uploaded.part_bytes == coordinator.ctx.settings.max_blob_bytes
    bundle = Bundle.from_bytes(coordinator.ctx.blobs.get(uploaded.manifest))
    weights = bundle.file("model.safetensors")
    assert weights.size > uploaded.part_bytes and len(weights.parts) > 1
    assert alice.missing_blobs(bundle.digests()).keys == []  # a second job uploads nothing
    assert spec.training.model.size.trainable < spec.training.model.size.parameters / 10
    job_id = alice.submit(spec).id
    assert alice.job(job_id).spec.training.model.uploaded == uploaded
    assert alice.quote(spec).vram_estimate_gb > 0


def test_the_server_refuses_a_model_it_does_not_hold_before_money_moves(coordinator, model_dir):
    alice = coordinator.consumer("alice", deposit=5)
    with pytest.raises(BadRequest, match="the model directory is not uploaded"):
        alice.submit(job(model_dir))
    spec = upload_model(alice, job(model_dir))
    bundle = Bundle.from_bytes(coordinator.ctx.blobs.get(spec.training.model.uploaded.manifest))
    weights = bundle.file("model.safetensors")
    unknown = weights.parts[0].model_copy(update={"sha256": "0" * 64})
    gap = weights.model_copy(update={"parts": [unknown, *weights.parts[1:]]})
    for manifest, expected in (
        (Bundle(files=[f for f in bundle.files if f.name != "config.json"]), "has no config.json"),
        (Bundle(files=[gap if f is weights else f for f in bundle.files]), "1 blobs of the model directory"),
    ):
        uploaded = UploadedModel(manifest=alice.upload(manifest.to_bytes()), part_bytes=1)
        model = spec.training.model.model_copy(update={"uploaded": uploaded})
        with pytest.raises(BadRequest, match=expected):
            alice.submit(
                spec.model_copy(update={"training": spec.training.model_copy(update={"model": model})})
            )
    assert alice.jobs() == [] and alice.balance().balance == 5
