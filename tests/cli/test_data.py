"""``gpuflex data prepare`` as a user runs it: a real process, its summary, and one line for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.data.helpers import documents, train_tokenizer, write_jsonl, write_parquet

from gpuflex.data.manifest import load_manifest


def gpuflex(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", "data", "prepare", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        write_jsonl(root / f"part-{i}.jsonl", documents(200, seed=i))
    train_tokenizer().save(str(root / "tokenizer.json"))
    return root


def test_prepare_writes_shards_and_a_manifest_and_says_what_it_wrote(corpus, tmp_path):
    out = tmp_path / "prepared"
    args = [str(corpus / "*.jsonl"), "--field", "text", "--tokenizer", str(corpus / "tokenizer.json")]
    result = gpuflex(*args, "-o", str(out), "--shard-tokens", "2000", "--val-tokens", "500", "--workers", "2")
    assert result.returncode == 0, result.stderr
    manifest = load_manifest(out).manifest
    assert manifest.documents == 600 and manifest.validation_tokens == 500 and manifest.dtype == "uint16"
    lines = result.stdout.splitlines()
    shards = len(manifest.train) + len(manifest.validation)
    assert (
        f"{shards} shards of uint16 ({len(manifest.train)} train, 1 validation): {manifest.tokens:,} tokens"
        in (result.stdout)
    )
    assert "validation: the last 500 tokens" in lines
    assert f"manifest: {out / 'manifest.json'} (sha256 {manifest.digest})" in lines
    assert "tokens (" in result.stdout  # the progress bar's count and rate


BAD_INPUT = {  # id: (what the input directory holds, the arguments, what the one line says)
    "no-match": (None, "{tmp}/*.jsonl -o {tmp}/out", "no input matched"),
    "not-json": ("bad_json", "{tmp}/d.jsonl -o {tmp}/out", "d.jsonl line 2: not JSON"),
    "no-field": ("jsonl", "{tmp}/d.jsonl --field body -o {tmp}/out", "d.jsonl line 1: no field 'body'"),
    "no-column": ("parquet", "{tmp}/d.parquet -o {tmp}/out", "has no column 'text' (its columns: body, n)"),
    "no-tokenizer-json": ("jsonl", "{tmp}/d.jsonl --tokenizer {tmp} -o {tmp}/out", "has no tokenizer.json"),
    "not-empty": (
        "jsonl",
        "{tmp}/d.jsonl -o {tmp}",
        "is not empty: choose another directory, or give --force",
    ),
    "too-little": ("jsonl", "{tmp}/d.jsonl --val-tokens 99999 -o {tmp}/out", "too few to keep 99999"),
    "both": ("jsonl", "{tmp}/d.jsonl --bytes --tokenizer x -o {tmp}/out", "not both"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_1(tmp_path, case):
    make, args, says = BAD_INPUT[case]
    if make == "bad_json":
        (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    elif make == "jsonl":
        write_jsonl(tmp_path / "d.jsonl", ["one", "two"])
    elif make == "parquet":
        write_parquet(tmp_path / "d.parquet", ["one"], column="body")
    result = gpuflex(*args.format(tmp=tmp_path).split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
