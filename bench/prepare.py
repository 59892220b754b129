"""``gpuflex data prepare``'s throughput against the same tokenizer called directly with its batch API.

    .venv/bin/python bench/prepare.py            # the standard library's source, 7 alternating runs each
    .venv/bin/python bench/prepare.py --quick    # 4 MB of it, 3 runs each (< 1 min on 2 cores)
    .venv/bin/python bench/prepare.py --data ~/my-texts

The text (UTF-8 files, split into documents at blank lines) is written as JSON Lines and a byte-level
BPE tokenizer is trained on it (``gpuflex.testing.train_bpe``). Then, alternating, so that other load
on a shared machine falls on both alike:

- ``prepare``: ``gpuflex.data.prepare.prepare`` on the JSONL file, as the command runs it (reading and
  parsing the JSON, encoding, writing and hashing the shards, the validation split, the manifest);
  only the interpreter's start and imports are left out;
- ``direct``: the documents already in memory, encoded in the same batches by one call each of
  ``Tokenizer.encode_batch_fast`` (the batch API without offsets, which prepare uses), and of
  ``encode_batch`` (the classic one, which computes offsets too), tokens counted, nothing written.

Both count the same tokens (each document's ids and its EOS) and use every core. The tokens/s are
each one's best run (on a machine others share, the least disturbed); ``ratio`` is the median over
runs of prepare's tokens/s over the direct run right after it, which saw about the same load (the
target is >= 0.8 on 2 cores), ``best_ratio`` the quotient of the bests. ``prepare_cpu_s`` and
``direct_cpu_s`` (medians, every thread's CPU seconds) say how much work prepare adds, which other
load on the machine hides less than it hides wall time. The last line of stdout is JSON:
``prepare_tokens_per_s``, ``tokenizer_direct_tokens_per_s`` (``encode_batch_fast``), ``ratio``,
``best_ratio``, ``tokenizer_direct_encode_batch_tokens_per_s``, ``prepare_cpu_s``, ``direct_cpu_s``,
``tokens``, ``documents``, ``bytes``, ``cores`` and every run's figures. ``bench/finetune.py`` reuses
``corpus_documents`` and ``measure``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from gpuflex.cli.train import text_extensions
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import BATCH_BYTES, Source
from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.testing import train_bpe
from gpuflex.train.corpus import build_corpus


def corpus_documents(source: str, max_bytes: int) -> list[str]:
    """The text under ``source`` ("stdlib" or a directory), split into documents at blank lines."""
    text = build_corpus(source, max_bytes, text_extensions(source)).decode()
    return [d for d in text.split("\n\n") if d.strip()]


def measure(documents: list[str], tokenizer_json: Path, workdir: Path, runs: int) -> dict:
    """prepare's tokens/s and the direct batch API's on the same documents, ``runs`` of each, alternating."""
    jsonl = workdir / "documents.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    direct = Tokenizer.from_file(str(tokenizer_json))
    batches = _batches(documents)
    figures: dict[str, list[float]] = {"prepare": [], "encode_batch_fast": [], "encode_batch": []}
    cpu_s: dict[str, list[float]] = {"prepare": [], "encode_batch_fast": [], "encode_batch": []}
    tokens = 0
    for _ in range(runs):
        started, cpu = time.perf_counter(), time.process_time()
        manifest = prepare(
            Source([str(jsonl)]), load_tokenizer(str(tokenizer_json)), workdir / "prepared", force=True
        )
        figures["prepare"].append(manifest.tokens / (time.perf_counter() - started))
        cpu_s["prepare"].append(time.process_time() - cpu)
        tokens = manifest.tokens
        for api in ("encode_batch_fast", "encode_batch"):
            encode = getattr(direct, api)
            started, cpu = time.perf_counter(), time.process_time()
            counted = sum(len(e) + 1 for batch in batches for e in encode(batch, add_special_tokens=False))
            figures[api].append(counted / (time.perf_counter() - started))
            cpu_s[api].append(time.process_time() - cpu)
            assert counted == tokens, f"{api} counted {counted} tokens, prepare wrote {tokens}"
    best = {name: max(values) for name, values in figures.items()}
    paired = [p / d for p, d in zip(figures["prepare"], figures["encode_batch_fast"], strict=True)]
    return {
        "prepare_tokens_per_s": round(best["prepare"]),
        "tokenizer_direct_tokens_per_s": round(best["encode_batch_fast"]),
        "ratio": round(statistics.median(paired), 3),
        "best_ratio": round(best["prepare"] / best["encode_batch_fast"], 3),
        "tokenizer_direct_encode_batch_tokens_per_s": round(best["encode_batch"]),
        "prepare_cpu_s": round(statistics.median(cpu_s["prepare"]), 2),
        "direct_cpu_s": round(statistics.median(cpu_s["encode_batch_fast"]), 2),
        "tokens": tokens,
        "documents": len(documents),
        "bytes": jsonl.stat().st_size,
        "cores": os.cpu_count(),
        "runs": {name: [round(v) for v in values] for name, values in figures.items()},
    }


def _batches(documents: list[str]) -> list[list[str]]:
    """The documents in batches of about ``BATCH_BYTES`` of text, as ``Source.batches`` cuts them."""
    out, batch, size = [], [], 0
    for document in documents:
        batch.append(document)
        size += len(document)
        if size >= BATCH_BYTES:
            out.append(batch)
            batch, size = [], 0
    return [*out, batch] if batch else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 MB of text, 3 runs each")
    parser.add_argument("--data", default="stdlib", help="a directory of UTF-8 text (default: the stdlib)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    documents = corpus_documents(args.data, 4_000_000 if args.quick else 64_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json = Path(tmp) / "tokenizer.json"
        train_bpe(documents, args.vocab_size).save(str(tokenizer_json))
        result = measure(documents, tokenizer_json, Path(tmp), runs=3 if args.quick else 7)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
