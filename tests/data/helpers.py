"""Small inputs made on the spot: a BPE tokenizer trained with ``tokenizers`` on a few KB of text, and
documents written as text files, JSON Lines, Parquet and a ``datasets`` directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from gpuflex.testing import train_bpe

EOS = "<|endoftext|>"
WORDS = ["the", "a", "shard", "token", "worker", "round", "model", "data", "cache", "node", "job"]
WORDS += ["of", "to", "and", "is", "in", "naïve", "数据", "🙂"]  # and text beyond ASCII


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` short documents of words, with newlines and non-ASCII text."""
    rng = random.Random(seed)
    return [
        "\n".join(" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 3)))
        for _ in range(count)
    ]


def train_tokenizer() -> Tokenizer:
    """A 300-token BPE of the documents' words, with ``EOS``."""
    return train_bpe(documents(400), vocab_size=300, eos=EOS)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], column: str = "text", row_group_size: int = 7) -> Path:
    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path
