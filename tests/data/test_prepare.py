"""prepare: the shards are the documents' ids with EOS after each, cut into fixed sizes, the last tokens
for validation; a run that stops leaves nothing behind, and a finished one is the same every time."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gpuflex.data.manifest import load_manifest
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import Source
from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.errors import BadRequest

from .helpers import EOS, documents, write_jsonl


def reference_ids(tokenizer_json: Path | None, docs: list[str]) -> list[int]:
    """What the stream must be, computed without gpuflex: each document encoded alone, then its EOS."""
    if tokenizer_json is None:
        return [b for d in docs for b in (d + "\n").encode()]
    reference = Tokenizer.from_file(str(tokenizer_json))
    eos = reference.token_to_id(EOS)
    return [i for d in docs for i in [*reference.encode(d, add_special_tokens=False).ids, eos]]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    docs=st.lists(st.text(max_size=30), min_size=1, max_size=25),
    shard_tokens=st.integers(1, 40),
    val_tokens=st.integers(1, 30),
)
def test_the_shards_in_order_are_each_document_then_eos_and_validation_is_the_last_tokens(
    tokenizer_json, kind, docs, shard_tokens, val_tokens
):
    path = tokenizer_json if kind == "bpe" else None
    expected = reference_ids(path, docs)
    with tempfile.TemporaryDirectory() as tmp:
        source = Source([str(write_jsonl(Path(tmp) / "d.jsonl", docs))])
        tokenizer = load_tokenizer(str(path) if path else None)
        if val_tokens >= len(expected):
            with pytest.raises(BadRequest, match="too few to keep"):
                prepare(
                    source, tokenizer, Path(tmp) / "out", shard_tokens=shard_tokens, val_tokens=val_tokens
                )
            assert not any((Path(tmp) / "out").iterdir())
            return
        manifest = prepare(
            source, tokenizer, Path(tmp) / "out", shard_tokens=shard_tokens, val_tokens=val_tokens
        )
        prepared = load_manifest(Path(tmp) / "out")
        train = np.concatenate(prepared.train).tolist()
        validation = np.concatenate(prepared.validation).tolist()
    assert train + validation == expected
    assert len(validation) == manifest.validation_tokens == val_tokens
    assert manifest.documents == len(docs) and manifest.tokens == len(expected)
    for split in (manifest.train, manifest.validation):
        assert all(s.tokens == shard_tokens for s in split[:-1]) and 0 < split[-1].tokens <= shard_tokens


def test_a_prepared_dataset_is_the_same_bytes_every_time(tmp_path, tokenizer_json):
    write_jsonl(tmp_path / "a.jsonl", documents(300))
    (tmp_path / "b.txt").write_text("a text file\n" * 40)
    source = Source([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    tokenizer = load_tokenizer(str(tokenizer_json))
    first = prepare(source, tokenizer, tmp_path / "one", shard_tokens=500, val_fraction=0.1)
    second = prepare(source, tokenizer, tmp_path / "two", shard_tokens=500, val_fraction=0.1)
    assert (tmp_path / "one" / "manifest.json").read_bytes() == (
        tmp_path / "two" / "manifest.json"
    ).read_bytes()
    assert first.digest == second.digest
    assert first.validation_tokens == -(-first.tokens // 10)  # ceil of a tenth
    assert [s.model_dump() for s in first.sources] == [
        {"path": str(tmp_path / "a.jsonl"), "kind": "jsonl", "bytes": (tmp_path / "a.jsonl").stat().st_size},
        {"path": str(tmp_path / "b.txt"), "kind": "text", "bytes": 480},
    ]
    assert first.bytes_read == sum(s.bytes for s in first.sources)


def test_an_output_directory_in_use_is_refused_unless_forced(tmp_path):
    (tmp_path / "d.txt").write_text("some text " * 100)
    source, tokenizer = Source([str(tmp_path / "d.txt")]), load_tokenizer(None)
    out = tmp_path / "out"
    prepare(source, tokenizer, out, shard_tokens=300)
    (out / "notes.md").write_text("mine")
    with pytest.raises(BadRequest, match="is not empty: choose another directory, or give --force"):
        prepare(source, tokenizer, out, shard_tokens=300)
    prepare(source, tokenizer, out, shard_tokens=2000, force=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "notes.md",
        "train-00000.bin",
        "validation-00000.bin",
    ]
    load_manifest(out)


def test_an_interrupted_prepare_leaves_no_manifest_no_shards_and_no_threads(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(6):  # a batch each: the reader and the encoder are still busy when Ctrl-C comes
        (tmp_path / "in" / f"{i}.txt").write_text("x" * (1 << 20))
    threads = threading.active_count()
    batches = []

    def interrupt(bytes_read: int, tokens: int) -> None:
        batches.append(tokens)
        if len(batches) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(
            Source([str(tmp_path / "in")]),
            load_tokenizer(None),
            tmp_path / "out",
            shard_tokens=300_000,
            progress=interrupt,
        )
    assert list((tmp_path / "out").iterdir()) == []
    assert threading.active_count() == threads


def test_bad_input_deep_in_a_file_removes_the_shards_already_written(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", documents(5000))
    with path.open("a") as f:
        f.write("{oops\n")
    with pytest.raises(BadRequest, match=r"d\.jsonl line 5001: not JSON"):
        prepare(Source([str(path)]), load_tokenizer(None), tmp_path / "out", shard_tokens=100)
    assert list((tmp_path / "out").iterdir()) == []


def test_inputs_with_no_text_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(BadRequest, match="the inputs hold no text"):
        prepare(Source([str(tmp_path / "empty.jsonl")]), load_tokenizer(None), tmp_path / "out")
