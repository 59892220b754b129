"""The manifest: strict, its own hash, and every shard checked against it when loaded."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from gpuflex.data.manifest import Manifest, load_manifest, read_manifest
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import Source
from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.errors import BadRequest, HashMismatch


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "d.txt").write_text("abcdefghij" * 100)
    out = tmp_path / "out"
    prepare(Source([str(tmp_path / "d.txt")]), load_tokenizer(None), out, shard_tokens=300, val_tokens=150)
    return out


def test_the_shards_load_as_memmaps_and_the_digest_is_the_files_sha256(prepared):
    loaded = load_manifest(prepared)
    assert [len(t) for t in loaded.train] == [300, 300, 251]  # 1,001 bytes: 851 train, 150 validation
    assert [len(t) for t in loaded.validation] == [150]
    assert all(isinstance(t, np.memmap) and t.dtype == np.dtype("<u2") for t in loaded.train)
    assert (
        bytes(np.concatenate(loaded.train + loaded.validation).astype(np.uint8))
        == b"abcdefghij" * 100 + b"\n"
    )
    assert loaded.manifest.digest == hashlib.sha256((prepared / "manifest.json").read_bytes()).hexdigest()
    assert np.memmap(prepared / "train-00000.bin", dtype="<u2", mode="r").tolist() == loaded.train[0].tolist()


def test_a_shard_whose_bytes_changed_is_named_by_the_error(prepared):
    shard = prepared / "train-00002.bin"
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(
        HashMismatch, match=r"shard train-00002\.bin hashes to [0-9a-f]{64}, the manifest says"
    ):
        load_manifest(prepared)
    shard.unlink()
    with pytest.raises(BadRequest, match=r"shard train-00002\.bin is missing"):
        load_manifest(prepared)


def test_the_manifest_is_strict(prepared):
    data = json.loads((prepared / "manifest.json").read_text())
    data["tokenizer"]["colour"] = "blue"
    (prepared / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BadRequest, match=r"tokenizer\.colour: unknown field"):
        read_manifest(prepared)
    with pytest.raises(BadRequest, match=r"has no manifest\.json: not a prepared dataset"):
        read_manifest(prepared.parent / "elsewhere")


def test_the_manifest_refuses_what_no_prepare_writes(prepared):
    good = json.loads((prepared / "manifest.json").read_text())
    Manifest.model_validate(good)
    bad_cases = {
        "a shard in the middle shorter than shard_tokens": {"shard_tokens": 400},
        "a dtype the vocabulary does not need": {"dtype": "uint32"},
        "totals that do not add up": {"tokens": 5},
        "an EOS outside the vocabulary": {"tokenizer": {**good["tokenizer"], "eos_id": 256}},
        "a shard file name that is a path": {"validation": [{**good["validation"][0], "file": "../x.bin"}]},
    }
    for why, change in bad_cases.items():
        with pytest.raises(ValueError):
            Manifest.model_validate({**good, **change})
            pytest.fail(why)
