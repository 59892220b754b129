"""Jobs on a model directory: uploaded as blobs in parts under the store's limit, checked again on the
server before any money moves, and sized for the market's VRAM estimate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from gpuflex.cli.deploy import upload_served_model
from gpuflex.cli.inputs import upload_model
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec, UploadedModel
from gpuflex.storage.bundles import Bundle, bundle_directory
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


def test_an_upload_says_what_it_sent_what_was_stored_and_what_trains(
    coordinator, model_dir, tmp_path, capsys
):
    alice = coordinator.consumer("alice", deposit=5)
    parts = len(bundle_directory(model_dir, coordinator.ctx.settings.max_blob_bytes)[1])

    def said() -> str:
        return " ".join(capsys.readouterr().out.split())

    upload_served_model(alice, model_dir)
    first = said()
    assert f"; uploaded {parts} blobs (" in first and "stored" not in first
    assert "parameters, " in first and "trained" not in first  # a deployment trains nothing
    trainable = upload_model(alice, job(model_dir)).training.model.size.trainable
    again = said()
    assert (
        f"({trainable:,} trained)" in again and f"; all {parts} blobs already stored, none uploaded" in again
    )
    edited = shutil.copytree(model_dir, tmp_path / "m")
    (edited / "config.json").write_text((edited / "config.json").read_text() + "\n")
    upload_served_model(alice, edited)
    assert f"; uploaded 1 of {parts} blobs (0.0 MB), the other {parts - 1} already stored" in said()


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


def test_a_job_no_online_gpu_can_hold_is_refused_before_anything_is_uploaded(
    coordinator, model_dir, tmp_path
):
    """Its one line says by how much and what would fit; the model's blobs never left this machine."""
    coordinator.node("core-1", core=True)
    for name in ("card-1", "card-2"):
        coordinator.node(name, gpu=m.GpuInfo(name="Tiny GPU", vram_gb=0.5, compute_capability="8.6"))
    token = Client(coordinator.url).create_account("alice").token
    Client(coordinator.url, token).deposit(5)
    spec = job(model_dir).model_dump(by_alias=True, exclude_none=True)
    spec["resources"] = {"workers": 2}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        [sys.executable, "-m", "gpuflex", "submit", "job.yaml", "--url", coordinator.url, "--token", token],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path), "COLUMNS": "200"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert "error: no online node can hold this job's workers: a worker needs ≈" in line
    assert "the largest online GPU node has 1 × 0.5 GB" in line and "set resources.min_vram_gb" in line
    assert "uploaded" not in done.stdout
    bundle = bundle_directory(model_dir, coordinator.ctx.settings.max_blob_bytes)[0]
    assert set(Client(coordinator.url, token).missing_blobs(bundle.digests()).keys) == set(bundle.digests())
