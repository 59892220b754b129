"""A job on a prepared dataset, at submit: upload only what the blob store lacks (``POST
/v1/blobs/missing``), and the coordinator's own checks of the manifest before any money moves."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from gpuflex.cli.data import upload_prepared
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.data.manifest import Manifest, TokenizerInfo, read_manifest
from gpuflex.errors import BadRequest, HashMismatch, Unauthorized
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec, parse_job_spec
from gpuflex.testing import prepare_bytes, write_corpus

from .conftest import running_coordinator

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # nothing here is SQL


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """4 train shards of 18,000 tokens (the last shorter) and one validation shard, in uint16."""
    root = tmp_path_factory.mktemp("prepared")
    write_corpus(root / "text")
    return prepare_bytes(root / "text", root / "prepared", shard_tokens=18_000, val_tokens=4_000)


def job(prepared, **training) -> JobSpec:
    return parse_job_spec(
        {
            "name": "p",
            "resources": {"workers": 2},
            "training": {"model": {"block_size": 32}, **training},
            "data": {"prepared": str(prepared)},
            "budget": 1,
        }
    )


def test_the_store_says_which_blobs_it_lacks_in_one_call(coordinator):
    alice = coordinator.consumer("alice")
    here, absent = alice.upload(b"here"), hashlib.sha256(b"absent").hexdigest()
    answer = alice.missing_blobs([absent, here, absent])
    assert answer == m.MissingBlobs(keys=[absent], max_blob_bytes=coordinator.ctx.settings.max_blob_bytes)
    assert coordinator.http.post("/v1/blobs/missing", json={"keys": [here]}).status_code == 401
    with pytest.raises(ValidationError, match="at most 4096 items"):
        m.BlobKeys(keys=[here] * (m.MAX_BLOB_KEYS + 1))  # a 422; the client asks 4,096 at a time
    assert (
        len(m.BlobKeys(keys=[here] * m.MAX_BLOB_KEYS).model_dump_json())
        < CoordinatorSettings().max_request_bytes
    )


def test_only_missing_shards_are_uploaded_so_a_resumed_or_second_upload_sends_nothing_twice(
    coordinator, prepared
):
    alice = coordinator.consumer("alice", deposit=5)
    manifest = read_manifest(prepared)
    assert len(manifest.train) == 4
    alice.upload((prepared / manifest.train[1].file).read_bytes())  # an upload cut short after one shard
    first = upload_prepared(alice, job(prepared), prepared)
    assert (first.manifest, first.shards, first.sent) == (manifest.digest, 5, 4)
    job_id = alice.submit(job(prepared), dataset=first.manifest).id
    second = upload_prepared(alice, job(prepared), prepared)
    assert (second.sent, second.sent_bytes) == (0, 0)
    assert alice.submit(job(prepared), dataset=second.manifest).id != job_id


def test_a_shard_that_changed_since_prepare_is_refused_before_anything_is_sent(
    coordinator, prepared, tmp_path
):
    alice = coordinator.consumer("alice")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "train-00002.bin").write_bytes(b"\0\0" * 18_000)
    with pytest.raises(HashMismatch, match=r"shard train-00002.bin of .* hashes to .*prepare it again"):
        upload_prepared(alice, job(copy), copy)
    assert alice.missing_blobs([read_manifest(copy).train[0].sha256]).keys  # nothing went up


def test_a_shard_over_the_blob_limit_is_refused_naming_shard_tokens(database_url, tmp_path, prepared):
    with running_coordinator(database_url, tmp_path, max_blob_bytes=20_000) as small:
        alice = small.consumer("alice")
        with pytest.raises(BadRequest) as err:
            upload_prepared(alice, job(prepared), prepared)
    assert err.value.message == (
        "shard train-00000.bin is 36,000 bytes, more than the coordinator's blob limit of 20,000: "
        "prepare the data again with --shard-tokens 10000 or less"
    )


def test_the_coordinator_checks_the_manifest_and_its_shards_before_escrow(coordinator, prepared):
    alice = coordinator.consumer("alice", deposit=5)
    manifest = read_manifest(prepared)
    spec = job(prepared)
    with pytest.raises(BadRequest, match="upload the dataset's manifest"):
        alice.submit(spec)
    with pytest.raises(BadRequest, match=r"dataset blob \w+ \(a prepared manifest\): format: "):
        alice.submit(spec, dataset=alice.upload(b'{"format": 2}'))
    with pytest.raises(BadRequest) as err:
        alice.submit(spec, dataset=alice.upload(manifest.to_bytes()))  # its shards never went up
    shard = manifest.train[0]
    assert err.value.message == (
        f"the blob store lacks 5 of the dataset's 5 shards: {shard.file} ({shard.sha256}), train-00001.bin "
        f"({manifest.train[1].sha256}), train-00002.bin ({manifest.train[2].sha256}) and 2 more; "
        "upload them first (HTTP 400)"
    )
    upload_prepared(alice, spec, prepared)
    bpe = TokenizerInfo(kind="hf", hash="a" * 64, vocab_size=300, eos_id=0)
    other = Manifest.model_validate({**manifest.model_dump(), "tokenizer": bpe})
    with pytest.raises(BadRequest, match="recipe char-gpt is byte-level"):  # the client would have said so
        alice.submit(spec, dataset=alice.upload(other.to_bytes()))
    with pytest.raises(
        BadRequest, match=r"validation split \(4000 tokens in 1 shard\(s\)\) is too small for block_size 4096"
    ):
        alice.submit(job(prepared, model={"block_size": 4096}), dataset=manifest.digest)
    assert alice.balance().balance == 5 and alice.jobs() == []  # no money moved, nothing written
    with pytest.raises(Unauthorized):
        type(alice)(coordinator.url).submit(spec, dataset=manifest.digest)
