"""Token shards on disk: fixed-size files of raw little-endian ids, hashed as they are written.

Raw ``.bin`` rather than ``.npy``: a shard is written as a stream before its length is known, and its
bytes are exactly its ids, so ``numpy.memmap(path, dtype="<u2")`` reads it and its sha256 is its blob
key. The stream is written to train shards first; once its length is known, ``split_validation`` moves
its last tokens into validation shards, re-reading only that tail and the one train shard it cuts.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import BinaryIO

import numpy as np

from gpuflex.data.manifest import Dtype, Shard, numpy_dtype
from gpuflex.errors import BadRequest

DEFAULT_SHARD_TOKENS = 16 * 1024 * 1024  # 32 MiB in uint16, 64 MiB in uint32: within a blob's default limit
DEFAULT_VAL_FRACTION = 0.01


class ShardWriter:
    """Appends ids to ``{split}-00000.bin``, ``{split}-00001.bin``, … of ``shard_tokens`` ids each."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, dtype: Dtype):
        if shard_tokens < 1:
            raise BadRequest(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.dtype = numpy_dtype(dtype)
        self.shards: list[Shard] = []
        self.paths: list[Path] = []  # every file opened, finished or not: what to remove if prepare fails
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, self.dtype)
        while len(tokens):
            if self._file is None:
                path = self.directory / f"{self.split}-{len(self.shards):05d}.bin"
                self.paths.append(path)
                self._file = open(path, "wb")  # noqa: SIM115 (held across calls, closed in _finish_shard)
            room = self.shard_tokens - self._count
            part, tokens = tokens[:room], tokens[room:]
            data = memoryview(part).cast("B")
            self._file.write(data)
            self._hash.update(data)
            self._count += len(part)
            if self._count == self.shard_tokens:
                self._finish_shard()

    def close(self) -> list[Shard]:
        """Finish the last (shorter) shard; the shards written, in order."""
        if self._file is not None:
            self._finish_shard()
        return self.shards

    def discard(self) -> None:
        """Remove every file this writer made (prepare failed or was interrupted)."""
        if self._file is not None:
            self._file.close()
        for path in self.paths:
            path.unlink(missing_ok=True)

    def _finish_shard(self) -> None:
        assert self._file is not None, "no shard open"
        self._file.close()
        self.shards.append(Shard(file=self.paths[-1].name, sha256=self._hash.hexdigest(), tokens=self._count))
        self._file, self._hash, self._count = None, hashlib.sha256(), 0


def validation_count(total: int, val_tokens: int | None, val_fraction: float) -> int:
    """How many of ``total`` tokens are for validation: ``val_tokens``, else ``val_fraction`` of them."""
    if total == 0:
        raise BadRequest("the inputs hold no text")
    if val_tokens is None and not 0 < val_fraction < 1:
        raise BadRequest(f"the validation fraction must be in (0, 1), got {val_fraction}")
    count = val_tokens if val_tokens is not None else math.ceil(total * val_fraction)
    if not 0 < count < total:
        raise BadRequest(
            f"{total} tokens are too few to keep {count} for validation and train on the rest: "
            "give more data or fewer validation tokens"
        )
    return count


def split_validation(
    train: ShardWriter, validation: ShardWriter, count: int
) -> tuple[list[Shard], list[Shard]]:
    """Move the last ``count`` ids of ``train``'s (closed) stream into ``validation``'s shards."""
    shards, directory = train.shards, train.directory
    cut = sum(s.tokens for s in shards) - count
    first, keep = divmod(cut, train.shard_tokens)
    for i in range(first, len(shards)):
        validation.write(
            np.memmap(directory / shards[i].file, dtype=train.dtype, mode="r")[keep if i == first else 0 :]
        )
    for shard in shards[first + (keep > 0) :]:
        (directory / shard.file).unlink()
    kept = shards[:first]
    if keep:
        path = directory / shards[first].file
        with open(path, "r+b") as f:
            f.truncate(keep * train.dtype.itemsize)
            f.seek(0)
            kept.append(
                Shard(file=path.name, sha256=hashlib.file_digest(f, "sha256").hexdigest(), tokens=keep)
            )
    return kept, validation.close()
