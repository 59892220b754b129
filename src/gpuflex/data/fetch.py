"""A prepared dataset's shards as a task reads them: each opened on first use, once, and checked.

``ShardReader`` opens shards by their manifest entry; a task asks only for the ones it needs (a worker:
its own and the validation split; an auditor: the audited worker's too), so nothing else is fetched.
``LocalShards`` reads a prepared directory (``gpuflex train local --prepared``). ``FetchedShards`` gets
shards by hash with a caller's ``fetch`` (the task's transport: this package speaks no HTTP), into a
node's ``ShardCache`` when it has one, else into memory. Every shard is checked against its sha256,
from the cache too (another job's task shares the cache, and a disk can rot): bytes that do not match
are fetched once more, then the task fails with ``HashMismatch`` naming the shard. ``cached`` is that
rule for any blob in the cache: a task's model files come through it too (``train.pretrained``).
An encrypted job's shards (``privacy.encrypt``) are stored, fetched and cached as ciphertext, named by
its hash; ``FetchedShards``' ``unseal`` opens each in memory once it checked out.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from gpuflex.data.cache import Pin, ShardCache
from gpuflex.data.manifest import Dtype, Shard, map_shard, numpy_dtype, open_shard
from gpuflex.errors import BadRequest, HashMismatch
from gpuflex.storage.blobs import sha256_hex
from gpuflex.storage.fetching import FETCH_WORKERS

FETCH_TRIES = 2  # a blob whose bytes do not match is fetched once more before the task gives up
T = TypeVar("T")


class ShardReader(ABC):
    """Opens shards, each once per process (thread-safe), ``FETCH_WORKERS`` at a time; ``opened`` lists
    their files in the order asked for. ``cache``: the node's cache it fetches into, if any (the task's
    model files go there too). A shard that failed to open fails the same way when asked for again."""

    cache: ShardCache | None = None

    def __init__(self) -> None:
        self._open: dict[str, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="shard-open")
        self.opened: list[str] = []

    def open(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        """The shard's tokens (read-only), once its bytes hash to ``shard.sha256``."""
        return self.open_all([shard], dtype)[0]

    def open_all(self, shards: Sequence[Shard], dtype: Dtype) -> list[np.ndarray]:
        """Each shard's tokens as ``open`` gives them, in order; those not open yet are loaded at once."""
        with self._lock:
            for shard in shards:
                if shard.sha256 not in self._open:
                    self._open[shard.sha256] = self._loader.submit(self._load, shard, dtype)
                    self.opened.append(shard.file)
            loads = [self._open[shard.sha256] for shard in shards]
        return [load.result() for load in loads]

    @abstractmethod
    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray: ...


class LocalShards(ShardReader):
    """The shards of a prepared directory on this machine (``cache``: the node's, for a federated worker's
    model files; its shards are read where they lie)."""

    def __init__(self, directory: Path, cache: ShardCache | None = None):
        super().__init__()
        self.directory, self.cache = Path(directory), cache

    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        return open_shard(self.directory / shard.file, shard, dtype)


class FetchedShards(ShardReader):
    """Shards fetched by hash with ``fetch``, kept in ``cache`` (pinned while this process lives) or, with
    no cache, in memory; ``unseal``: an encrypted job's, opened in memory after the ciphertext checked out."""

    def __init__(
        self,
        fetch: Callable[[str], bytes],
        cache: ShardCache | None = None,
        unseal: Callable[[bytes], bytes] | None = None,
    ):
        super().__init__()
        self.fetch, self.cache, self.unseal = fetch, cache, unseal
        self._pins: list[Pin] = []  # held until the process ends: its memmaps read the cached files

    def _load(self, shard: Shard, dtype: Dtype) -> np.ndarray:
        what = f"shard {shard.file}"
        if self.cache is None:
            data = _tries(what, shard.sha256, lambda: _checked(self.fetch(shard.sha256), shard.sha256))
        else:
            self._pins.append(self.cache.pin(shard.sha256))
            path = cached(self.cache, shard.sha256, what, lambda: [self.fetch(shard.sha256)])
            if self.unseal is None:
                return map_shard(path, shard, dtype)
            data = path.read_bytes()
        if self.unseal is not None:
            data = self.unseal(data)
        tokens = np.frombuffer(data, numpy_dtype(dtype))
        if len(tokens) != shard.tokens:
            raise BadRequest(
                f"shard {shard.file} holds {len(tokens)} tokens, the manifest says {shard.tokens}"
            )
        return tokens


def cached(cache: ShardCache, digest: str, what: str, chunks: Callable[[], Iterable[bytes]]) -> Path:
    """Blob ``digest``'s path in ``cache``, which the caller has pinned: the cached copy if it still hashes
    to ``digest`` (another task shares the cache, and a disk can rot; a spoilt copy is dropped), else the
    bytes of ``chunks()`` put there, fetched once more if they do not match, then ``HashMismatch`` naming
    ``what``."""
    path = cache.get(digest)
    if path is not None:
        with path.open("rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() == digest:
                return path
        cache.drop(digest)
    return _tries(what, digest, lambda: cache.put_stream(digest, chunks()))


def _checked(data: bytes, digest: str) -> bytes:
    if sha256_hex(data) != digest:
        raise HashMismatch(f"they hash to {sha256_hex(data)}")
    return data


def _tries(what: str, digest: str, attempt: Callable[[], T]) -> T:
    got = ""
    for _ in range(FETCH_TRIES):
        try:
            return attempt()
        except HashMismatch as err:  # the transport, the cache or ``_checked`` saw it
            got = err.message
    raise HashMismatch(f"{what} arrived corrupted {FETCH_TRIES} times (its sha256 should be {digest}; {got})")
