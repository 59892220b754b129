"""Which tokens each worker trains on, and the batches it draws from them, reproducibly.

Assignment is contiguous, by whole shards: worker i of n gets shards ``[i·S/n, (i+1)·S/n)`` of the S
train shards, so it downloads only those, and every worker gets at least one when S >= n. With fewer
shards than workers, the train stream is cut into n contiguous token ranges of equal length instead
(workers then share a shard, each reading its own range of it). Either way a worker's part is a list
of ``Span``s; both rules are pure functions of the manifest's token counts.

Batches are windows of ``block_size + 1`` tokens at offsets drawn from a ``torch.Generator`` the caller
seeds (``gpuflex.train.data.round_generator(seed, worker, round)``: the seed derivation stays in
``train``, which may import this package, not the other way), so a round's batches are reproducible
from (manifest, seed, worker, round) by an auditor. A window never crosses from one span into the next.
On one span the draws are exactly ``train.data.sample_batch``'s. Validation batches are one fixed set,
evenly spaced, so validation losses of different rounds compare.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gpuflex.errors import BadRequest

# torch is imported where batches are made: the CLI and the coordinator check fits without loading it
if TYPE_CHECKING:
    import torch
    from torch import Tensor

    Batch = tuple[Tensor, Tensor]  # inputs and next-token targets, both (batch, block) int64


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, stop)`` of train shard ``shard``."""

    shard: int
    start: int
    stop: int


def assign(shard_tokens: Sequence[int], worker: int, workers: int) -> list[Span]:
    """Worker ``worker``'s part of train shards holding ``shard_tokens`` tokens each, in stream order."""
    if not 0 <= worker < workers:
        raise BadRequest(f"worker must be in [0, {workers}), got {worker}")
    count = len(shard_tokens)
    if count >= workers:
        shards = range(worker * count // workers, (worker + 1) * count // workers)
        return [Span(s, 0, shard_tokens[s]) for s in shards]
    total = sum(shard_tokens)
    if total < workers:
        raise BadRequest(f"{total} train tokens cannot be split among {workers} workers")
    lo, hi = worker * total // workers, (worker + 1) * total // workers
    spans, offset = [], 0
    for shard, size in enumerate(shard_tokens):
        start, stop = max(lo - offset, 0), min(hi - offset, size)
        if start < stop:
            spans.append(Span(shard, start, stop))
        offset += size
    return spans


def worker_tokens(train: Sequence[np.ndarray], worker: int, workers: int) -> list[np.ndarray]:
    """The views of a prepared dataset's ``train`` shards that worker ``worker`` trains on."""
    return [train[s.shard][s.start : s.stop] for s in assign([len(t) for t in train], worker, workers)]


def window_count(lengths: Sequence[int], block_size: int) -> int:
    """How many windows of ``block_size + 1`` tokens lie inside parts of these lengths (none crosses two)."""
    return sum(max(n - block_size, 0) for n in lengths)


def check_fits(
    train: Sequence[int],
    validation: Sequence[int],
    workers: int,
    block_size: int,
    more_validation: str = "prepare with more --val-tokens",
) -> None:
    """BadRequest, naming the numbers, unless every worker's part (of train shards holding ``train`` tokens
    each) and the validation shards (``validation``) hold a window of ``block_size + 1`` tokens;
    ``more_validation`` says how to get a longer validation split."""
    need = f"a window is block_size + 1 = {block_size + 1} tokens within one shard"
    for worker in range(workers):
        spans = assign(train, worker, workers)
        if not window_count([s.stop - s.start for s in spans], block_size):
            raise BadRequest(
                f"the dataset is too small for {workers} workers x block_size {block_size}: "
                f"worker {worker}'s "
                f"part is {sum(s.stop - s.start for s in spans)} tokens in {len(spans)} span(s) of "
                f"{sum(train)} train tokens in {len(train)} shard(s), and {need}: "
                "prepare more data, or use fewer workers or a smaller block_size"
            )
    if not window_count(validation, block_size):
        raise BadRequest(
            f"the dataset's validation split ({sum(validation)} tokens in {len(validation)} shard(s)) is too "
            f"small for block_size {block_size}: {need}; {more_validation}"
        )


def batches(
    parts: Sequence[np.ndarray], batch_size: int, block_size: int, generator: torch.Generator
) -> Iterator[Batch]:
    """Endless batches of ``batch_size`` windows at random offsets of ``parts``, drawn from ``generator``."""
    windows = Windows(parts, block_size)
    while True:
        yield windows.sample(batch_size, generator)


def validation_batches(
    parts: Sequence[np.ndarray], count: int, batch_size: int, block_size: int
) -> list[Batch]:
    """``count`` batches of windows at evenly spaced offsets of ``parts``: the same set every time."""
    import torch

    windows = Windows(parts, block_size)
    starts = torch.linspace(0, windows.count - 1, count * batch_size).long()
    return [windows.batch(s) for s in starts.split(batch_size)]


class Windows:
    """Every window of ``block_size + 1`` tokens inside one part, numbered across the parts in order."""

    def __init__(self, parts: Sequence[np.ndarray], block_size: int):
        self.parts, self.block_size = parts, block_size
        per_part = np.array([max(len(p) - block_size, 0) for p in parts], dtype=np.int64)
        self.ends = np.cumsum(per_part)
        self.starts = self.ends - per_part
        self.count = int(self.ends[-1]) if len(parts) else 0
        if self.count == 0:
            raise BadRequest(
                f"{sum(len(p) for p in parts)} tokens hold no window of block_size + 1 = {block_size + 1}: "
                "use more data, fewer workers or a smaller block_size"
            )

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` windows at offsets drawn from ``generator``."""
        import torch

        return self.batch(torch.randint(self.count, (batch_size,), generator=generator))

    def batch(self, indices: Tensor) -> Batch:
        import torch

        index = indices.numpy()
        part = np.searchsorted(self.ends, index, side="right")
        offset = index - self.starts[part]
        chunk = np.stack(
            [self.parts[p][o : o + self.block_size + 1] for p, o in zip(part, offset, strict=True)]
        )
        tokens = torch.from_numpy(chunk.astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]
