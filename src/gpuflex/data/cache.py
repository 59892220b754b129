"""A worker's on-disk cache of shards and model files, keyed by sha256 and shared by its jobs.

Jobs on one node often train on the same data, or fine-tune the same base model, so a shard or a model
file is fetched once per node, not once per job. The cache holds at most ``limit_bytes`` of blobs:
making room evicts the least recently used (``get`` and ``put`` touch a blob), never a pinned one. A job
pins each blob it uses before it reads it and holds the pin while it runs; pins are shared ``flock``
locks on a file per blob, so they are released when the job's process ends however it ends, and an
evictor tells a pinned blob by failing to take that lock exclusively. Several processes may use one
cache: changes happen under an exclusive lock on ``root/lock``, and a blob appears by an atomic rename,
never half written.

Layout: ``root/blobs/<sha256>``, ``root/pins/<sha256>`` (empty lock files), ``root/lock``.

Use::

    with cache.pin(digest):
        path = cache.get(digest) or cache.put(digest, fetch(digest))
        ...  # read path while pinned
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuflex.errors import BadRequest, Conflict, HashMismatch
from gpuflex.storage.blobs import validate_digest


class Pin:
    """Holds one blob in the cache until released (or its process ends)."""

    def __init__(self, fd: int, digest: str):
        self.digest = digest
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops its flock
            self._fd = None

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ShardCache:
    def __init__(self, root: Path, limit_bytes: int):
        if limit_bytes < 1:
            raise BadRequest(f"a cache's limit must be at least 1 byte, got {limit_bytes}")
        self.root, self.limit_bytes = Path(root), limit_bytes
        self._blobs, self._pins = self.root / "blobs", self.root / "pins"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._pins.mkdir(exist_ok=True)

    def get(self, digest: str) -> Path | None:
        """The blob's path, touched as just used, or None if the cache does not hold it."""
        path = self._blobs / validate_digest(digest)
        try:
            _touch(path)
        except FileNotFoundError:
            return None
        return path

    def put(self, digest: str, data: bytes) -> Path:
        """Keep ``data`` as blob ``digest`` (see ``put_stream``); its path."""
        return self.put_stream(digest, [data])

    def put_stream(self, digest: str, chunks: Iterable[bytes]) -> Path:
        """Keep the bytes of ``chunks`` as blob ``digest``, evicting unpinned blobs to make room; its path.

        The chunks go to a temporary file beside the blobs (a model file joined from its parts is never
        whole in memory), hashed as written. HashMismatch if they do not hash to ``digest`` (nothing
        kept); Conflict if they outgrow the limit, or the pinned blobs leave no room for them.
        """
        path = self._blobs / validate_digest(digest)
        fd, tmp = tempfile.mkstemp(dir=self._blobs, prefix=".tmp-")  # hidden: ``_entries`` skips it
        try:
            hashed, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    size += len(chunk)
                    if size > self.limit_bytes:
                        raise Conflict(
                            f"a blob of at least {size} bytes does not fit a cache of {self.limit_bytes}"
                        )
                    hashed.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if hashed.hexdigest() != digest:
                raise HashMismatch(f"the bytes fetched for {digest} hash to {hashed.hexdigest()}: not cached")
            with self._locked():
                if not path.exists():
                    self._make_room(size)
                    os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        _touch(path)
        return path

    def drop(self, digest: str) -> None:
        """Remove blob ``digest``, found damaged on disk (its pins stay: their holders fetch it again)."""
        with self._locked():
            (self._blobs / validate_digest(digest)).unlink(missing_ok=True)

    def pin(self, digest: str) -> Pin:
        """Keep blob ``digest`` from eviction, held or not yet: pin first, then get or put."""
        path = self._pins / validate_digest(digest)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while an evictor holds it exclusively
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:  # else an evictor removed the file we locked: pin the new one
                return Pin(fd, digest)
            os.close(fd)

    def size(self) -> int:
        """Bytes of the blobs held (the figure the limit bounds)."""
        return sum(size for _, _, size in self._entries())

    def _make_room(self, need: int) -> None:
        entries = sorted(self._entries())  # least recently used first
        held = sum(size for _, _, size in entries)
        for _, digest, size in entries:
            if held + need <= self.limit_bytes:
                break
            if self._evict(digest):
                held -= size
        if held + need > self.limit_bytes:
            raise Conflict(
                f"the shard cache cannot take {need} more bytes within its limit of {self.limit_bytes}: "
                f"{held} are held by blobs that running jobs have pinned"
            )

    def _evict(self, digest: str) -> bool:
        """Remove an unpinned blob; False if a job pins it."""
        pin = self._pins / digest
        fd = os.open(pin, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            (self._blobs / digest).unlink(missing_ok=True)
            pin.unlink()  # under the exclusive lock: a pinner waiting on it sees the file gone and retries
        finally:
            os.close(fd)
        return True

    def _entries(self) -> Iterator[tuple[int, str, int]]:
        """(last use in ns, digest, bytes) of every blob held."""
        with os.scandir(self._blobs) as found:
            for entry in found:
                if entry.name.startswith("."):  # write_atomic's temporary files
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # evicted by another process since listed (size() takes no lock)
                    continue
                yield stat.st_mtime_ns, entry.name, stat.st_size

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _touch(path: Path) -> None:
    now = time.time_ns()
    os.utime(path, ns=(now, now))
