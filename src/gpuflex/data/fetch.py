"""A prepared dataset's shards as a task reads them: each opened on first use, once, and checked.

``ShardReader`` opens shards by their manifest entry; a task asks only for the ones it needs (a worker:
its own and the validation split; an auditor: the audited worker's too), so nothing else is fetched.
``LocalShards`` reads a prepared directory (``gpuflex train local --prepared``). ``FetchedShards`` gets
shards by hash with a caller's ``fetch`` (the task's transport: this package speaks no HTTP), into a
node's ``ShardCache`` when it has one, else into memory. Every shard is checked against its sha256,
from the cache too (another job's task shares the cache, and a disk can rot): bytes that do not match
are fetched once more, then the task fails with ``HashMismatch`` naming the shard.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gpuflex.data.cache import Pin, ShardCache
from gpuflex.data.manifest import Dtype, Shard, numpy_dtype, open_shard
from gpuflex.errors import HashMismatch
from gpuflex.storage.blobs import sha256_hex

FETCH_TRIES = 2  # a shard whose bytes do not match is fetched once more before the task gives up


class ShardReader(ABC):
    """Opens shards, each once per process (thread-safe); ``opened`` lists their files in order."""

    def __init__(self) -> None:
        self._open: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.opened: list[str] = []

    def open(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        """The shard's tokens (read-only), once its bytes hash to ``shard.sha256``."""
        with self._lock:
            if shard.sha256 not in self._open:
                self._open[shard.sha256] = self._load(shard, dtype)
                self.opened.append(shard.file)
            return self._open[shard.sha256]

    @abstractmethod
    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray: ...


class LocalShards(ShardReader):
    """The shards of a prepared directory on this machine."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = Path(directory)

    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        return open_shard(self.directory / shard.file, shard, dtype)


class FetchedShards(ShardReader):
    """Shards fetched by hash with ``fetch``, kept in ``cache`` (pinned while this process lives) or, with
    no cache, in memory."""

    def __init__(self, fetch: Callable[[str], bytes], cache: ShardCache | None = None):
        super().__init__()
        self.fetch, self.cache = fetch, cache
        self._pins: list[Pin] = []  # held until the process ends: its memmaps read the cached files

    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        if self.cache is None:
            return np.frombuffer(self._fetch(shard), numpy_dtype(dtype))
        self._pins.append(self.cache.pin(shard.sha256))
        path = self.cache.get(shard.sha256)
        if path is not None:
            try:
                return open_shard(path, shard, dtype)
            except HashMismatch:
                self.cache.drop(shard.sha256)  # damaged on disk: fetch it again
        return open_shard(self.cache.put(shard.sha256, self._fetch(shard)), shard, dtype)

    def _fetch(self, shard: Shard) -> bytes:
        got = ""
        for _ in range(FETCH_TRIES):
            try:
                data = self.fetch(shard.sha256)
            except HashMismatch as err:  # the transport checked it already
                got = err.message
                continue
            if sha256_hex(data) == shard.sha256:
                return data
            got = f"they hash to {sha256_hex(data)}"
        raise HashMismatch(
            f"shard {shard.file} arrived corrupted {FETCH_TRIES} times "
            f"(the manifest says {shard.sha256}; {got})"
        )
