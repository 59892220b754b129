"""The byte-level dataset (vocabulary 256): split, shards and reproducible batches.

The first 90% of the corpus is for training, split into one contiguous shard per worker;
the last 10% is for validation. Training batches come from a generator seeded by
(seed, worker, round), so a re-run of a round draws the same batches; validation batches are
one fixed set, so validation losses of different rounds are comparable.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from gpuflex.data.fit import text_split
from gpuflex.errors import BadRequest

VOCAB_SIZE = 256

Batch = tuple[Tensor, Tensor]  # inputs and next-byte targets, both (batch, block) int64


class ByteDataset:
    """A corpus as bytes, split into train (first 90%) and validation (last 10%): ``data.fit.text_split``."""

    def __init__(self, corpus: bytes, block_size: int):
        if not corpus:
            raise BadRequest("the dataset is empty")
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_train, _ = text_split(len(tokens))  # the split ``gpuflex submit`` checks the corpus by
        self.block_size = block_size
        self.train = tokens[:n_train]
        self.val = tokens[n_train:]
        _check_long_enough(self.val, block_size, "the validation split")

    def shard(self, worker_index: int, num_workers: int) -> Tensor:
        """Worker ``worker_index``'s contiguous slice of the training split."""
        if not 0 <= worker_index < num_workers:
            raise BadRequest(f"worker_index must be in [0, {num_workers}), got {worker_index}")
        size = len(self.train) // num_workers
        part = self.train[worker_index * size : (worker_index + 1) * size]
        _check_long_enough(part, self.block_size, f"shard {worker_index} of {num_workers}")
        return part


def round_seed(seed: int, worker_index: int, round: int, rank: int = 0) -> int:
    """The seed of a worker's batches in a round: what its commitment names and an auditor regenerates."""
    key = f"{seed}/{worker_index}/{round}" + (f"/{rank}" if rank else "")  # rank 0: as before ranks existed
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def round_generator(seed: int, worker_index: int, round: int, rank: int = 0) -> torch.Generator:
    """A generator whose stream depends only on (seed, worker_index, round, local rank)."""
    return torch.Generator().manual_seed(round_seed(seed, worker_index, round, rank))


def sample_batch(tokens: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> Batch:
    """``batch_size`` windows of ``block_size + 1`` bytes at random offsets of ``tokens``."""
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    return _windows(tokens, starts, block_size)


def validation_batches(val: Tensor, count: int, batch_size: int, block_size: int) -> list[Batch]:
    """``count`` batches of windows at evenly spaced offsets: the same set every time."""
    starts = torch.linspace(0, len(val) - block_size - 1, count * batch_size).long()
    return [_windows(val, s, block_size) for s in starts.split(batch_size)]


def _windows(tokens: Tensor, starts: Tensor, block_size: int) -> Batch:
    chunk = tokens[starts[:, None] + torch.arange(block_size + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


def _check_long_enough(tokens: Tensor, block_size: int, what: str) -> None:
    """At least one window of ``block_size + 1`` bytes: ``data.assign.check_fits``'s rule, which ``gpuflex
    submit`` checks a corpus by."""
    if len(tokens) < block_size + 1:
        raise BadRequest(
            f"{what} has {len(tokens)} bytes, too few for block_size {block_size}: "
            "use a larger corpus, fewer workers or a smaller block_size"
        )
