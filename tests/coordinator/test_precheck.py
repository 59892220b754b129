"""Check before carrying (issue 40): `gpuflex submit` and `gpuflex deploy --model` refuse what the
coordinator or this machine would refuse of a job or deployment before its model directory (or any
large blob) is uploaded. The coordinator's rules run on it without the blobs (``POST /v1/jobs/check``,
``POST /v1/deployments/check``), and write nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gpuflex.cli.main import app
from gpuflex.client import Client
from gpuflex.data.manifest import read_manifest
from gpuflex.errors import BadRequest, GPUFlexError, InsufficientFunds
from gpuflex.protocol.deployment import DeployedModel, DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage.bundles import bundle_directory
from gpuflex.testing import save_llama, write_corpus

# the CLI's checks are the same on either database: run once; the coordinator's check routes on both
SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

TOO_SMALL = r"the dataset's validation split \(\d+ tokens in 1 shard\(s\)\) is too small for block_size 128"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A text, two model directories (``save_pretrained``: a vocabulary of 301 ids and one of 258), and
    data prepared with the larger's tokenizer: one with a validation split of 100 tokens, one of 4,000."""
    from gpuflex.data.prepare import prepare
    from gpuflex.data.sources import Source
    from gpuflex.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("made")
    write_corpus(root / "text")
    documents = [p.read_text() for p in sorted((root / "text").iterdir())]
    save_llama(root / "model", documents, hidden=16, vocab_size=320)
    save_llama(root / "narrow", documents, hidden=16, vocab_size=258)
    tokenizer = load_tokenizer(str(root / "model"))
    for name, val_tokens in (("short-val", 100), ("data", 4_000)):
        prepare(
            Source([str(root / "text")]), tokenizer, root / name, shard_tokens=20_000, val_tokens=val_tokens
        )
    return root


def job(made: Path, data: str = "data", model: str = "model", budget: float = 1.0) -> dict:
    return {
        "name": "tune",
        "training": {
            "recipe": "hf-causal-lm",
            "model": {"from": str(made / model), "block_size": 128},
            "lora": {"r": 4},
        },
        "data": {"prepared": str(made / data)},
        "budget": budget,
    }


def gpuflex(url: str, token: str, *args: str) -> str:
    """A `gpuflex` command that fails: its error, on one line."""
    done = CliRunner().invoke(app, [*args, "--url", url, "--token", token])
    assert isinstance(done.exception, GPUFlexError), done.output
    return " ".join(f"{done.exception.message} {done.output}".split())


def submit(coordinator, tmp_path: Path, spec: dict, deposit: float = 5) -> str:
    """`gpuflex submit` of ``spec`` by a new account, refused: its error, and what it printed."""
    token = Client(coordinator.url).create_account("alice").token
    Client(coordinator.url, token).deposit(deposit)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    refused = gpuflex(coordinator.url, token, "submit", str(tmp_path / "job.yaml"))
    assert Client(coordinator.url, token).jobs() == []
    return refused


def no_model_part_stored(coordinator, model_dir: Path) -> bool:
    bundle, parts = bundle_directory(model_dir, coordinator.ctx.settings.max_blob_bytes)
    return not any(
        coordinator.ctx.blobs.exists(key) for key in [*bundle.digests(), *(p.sha256 for p in parts)]
    )


@SQLITE
def test_a_validation_split_too_small_is_refused_before_the_model_is_uploaded(coordinator, made, tmp_path):
    error = submit(coordinator, tmp_path, job(made, data="short-val"))
    assert error.startswith("the dataset's validation split (")
    assert "is too small for block_size 128: a window is block_size + 1 = 129 tokens" in error
    assert "uploaded" not in error
    assert no_model_part_stored(coordinator, made / "model")


@SQLITE
def test_a_text_too_short_for_the_block_size_is_refused_before_the_model_is_uploaded(
    coordinator, made, tmp_path
):
    spec = job(made)
    spec["data"] = {"source": str(made / "text"), "max_bytes": 10_000, "extensions": [".txt"]}
    spec["training"]["model"]["block_size"] = 1024
    error = submit(coordinator, tmp_path, spec)
    assert error.startswith(
        "the dataset's validation split (1000 tokens in 1 shard(s)) is too small for block_size 1024"
    )
    assert "give more text (data.source, data.max_bytes)" in error
    assert no_model_part_stored(coordinator, made / "model")


@SQLITE
def test_a_dataset_tokenized_for_another_model_is_refused_before_the_model_is_uploaded(
    coordinator, made, tmp_path
):
    error = submit(coordinator, tmp_path, job(made, model="narrow"))
    assert error.startswith(
        "the dataset's tokenizer has a vocabulary of 301 ids, more than the model's 258 embeddings: "
        "prepare the data with the model's own tokenizer"
    )
    assert no_model_part_stored(coordinator, made / "narrow")


@SQLITE
def test_a_budget_the_wallet_cannot_cover_is_refused_before_anything_large_is_uploaded(
    coordinator, made, tmp_path
):
    error = submit(coordinator, tmp_path, job(made, budget=5), deposit=2)
    assert error.startswith(
        "your wallet holds 2.00 credits and this job's budget is 5.00: add 3.00 with "
        "`gpuflex wallet deposit 3.00`, or lower the budget (HTTP 402)"
    )
    assert no_model_part_stored(coordinator, made / "model")
    manifest = read_manifest(made / "data")
    assert not any(coordinator.ctx.blobs.exists(s.sha256) for s in manifest.train + manifest.validation)


def test_the_coordinator_checks_a_submission_without_its_blobs_and_writes_nothing(coordinator, made):
    """The rules are the coordinator's: asked without the model or the shards (only the manifest, small),
    it refuses as submit would, and with nothing to refuse it answers 204 and nothing moves."""
    from gpuflex.cli.data import check_prepared, stage_prepared
    from gpuflex.train.pretrained import sized

    alice = coordinator.consumer("alice", deposit=5)
    sized_job = JobSpec.model_validate(job(made))
    sized_job = sized_job.model_copy(update={"training": sized(sized_job.training)})
    dataset = stage_prepared(alice, check_prepared(sized_job, made / "data"), sealed=False)
    assert alice.check_submit(sized_job, dataset=dataset) is None
    short = read_manifest(made / "short-val")
    alice.upload(short.to_bytes())  # the manifest alone
    with pytest.raises(BadRequest, match=TOO_SMALL):
        alice.check_submit(sized_job, dataset=short.digest)
    unsized = JobSpec.model_validate({**job(made), "data": {}})  # on text: no manifest to check first
    with pytest.raises(BadRequest, match=r"training\.model\.from: the model directory is not sized"):
        alice.check_submit(unsized)
    with pytest.raises(
        InsufficientFunds, match=r"your wallet holds 5\.00 credits and this job's budget is 6\.00"
    ):
        alice.check_submit(sized_job.model_copy(update={"budget": 6}), dataset=dataset)
    with pytest.raises(BadRequest, match="upload the dataset's manifest"):
        alice.check_submit(sized_job)
    assert alice.jobs() == [] and alice.balance().balance == 5
    assert no_model_part_stored(coordinator, made / "model")
    assert not any(coordinator.ctx.blobs.exists(s.sha256) for s in read_manifest(made / "data").train)


def test_deploy_model_with_a_bad_spec_or_budget_is_refused_before_the_upload(coordinator, made):
    token = Client(coordinator.url).create_account("alice").token
    alice = Client(coordinator.url, token)
    alice.deposit(2)
    deploy = ("deploy", "--model", str(made / "model"))
    assert gpuflex(coordinator.url, token, *deploy, "--name", "a b").startswith("invalid deployment: name: ")
    assert gpuflex(coordinator.url, token, *deploy, "--budget", "3").startswith(
        "your wallet holds 2.00 credits and this job's budget is 3.00: add 1.00 with "
        "`gpuflex wallet deposit 1.00`"
    )
    assert no_model_part_stored(coordinator, made / "model")
    assert alice.deployments() == [] and alice.balance().balance == 2
    spec = DeploymentSpec(name="m", model=DeployedModel(from_=str(made / "model")), budget=1)
    with pytest.raises(BadRequest, match=r"model\.from: the model directory is not sized"):
        alice.check_deploy(spec)
