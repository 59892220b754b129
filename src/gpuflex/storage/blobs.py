"""Blobs are immutable and named by their sha256, so any copy can be checked and nothing is overwritten.

A key is exactly 64 lower-case hex digits; anything else (``../``, slashes, upper case) is refused
before it can reach a path. A blob arrives as a stream of chunks (``upload``): hashed and counted as it
is written to a temporary file, and stored under its key only once whole, within its size limit and
hashing to the key, so memory holds one chunk at a time whatever the blob's size, and neither a crash nor
a wrong or oversized body leaves anything under a valid name. ``open`` reads a blob as a seekable file,
so a reader streams it, or a range of it, in chunks.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gpuflex.errors import BadRequest, NotFound, PayloadTooLarge, ServiceError

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise BadRequest("a blob key must be 64 lower-case hex digits (its sha256)")
    return digest


@dataclass(frozen=True)
class Presigned:
    """A URL that lets its holder move one blob's bytes to or from the store itself, until ``expires_at``
    (Unix time): the request must carry ``headers``, which the signature covers. ``upload`` names the
    staged object a PUT lands in, for ``BlobStore.commit_upload``."""

    url: str
    expires_at: float
    length: int
    headers: dict[str, str] = field(default_factory=dict)
    upload: str | None = None


class BlobStore(ABC):
    """Put and get immutable blobs by sha256. A store that can sign URLs (S3) lets readers and writers
    move the bytes themselves; the others (a directory, memory) answer ``None`` and the coordinator
    carries them."""

    @abstractmethod
    def check(self) -> None:
        """Raise ``ServiceError`` with the reason if the store cannot be written."""

    def presign_get(self, digest: str, expires_at: float) -> Presigned | None:
        """A URL to GET blob ``digest`` from (``NotFound`` if absent), or None if the store signs none."""
        return None

    def presign_put(self, digest: str, length: int, expires_at: float) -> Presigned | None:
        """A URL to PUT exactly ``length`` bytes hashing to ``digest`` to, or None if the store signs none."""
        return None

    def commit_upload(self, digest: str, upload: str) -> None:
        """Make a presigned upload blob ``digest`` once the store has checked its bytes; refused otherwise."""
        raise BadRequest("this blob store takes uploads through the coordinator: PUT /v1/blobs/{digest}")

    staging: Path | None = None  # where uploads are written before they are stored (None: the system's)

    def upload(self, expected: str | None = None, limit: int | None = None) -> BlobUpload:
        """A blob to write in chunks; ``expected``: the key it must hash to, ``limit``: its most bytes."""
        return BlobUpload(self, expected, limit)

    def put_stream(
        self, chunks: Iterable[bytes], expected: str | None = None, limit: int | None = None
    ) -> str:
        """Store the bytes of ``chunks`` (see ``BlobUpload``); their sha256."""
        with self.upload(expected, limit) as upload:
            for chunk in chunks:
                upload.write(chunk)
            return upload.finish()

    def put(self, data: bytes, expected: str | None = None) -> str:
        """Store ``data``; if ``expected`` is given, refuse data whose hash differs."""
        return self.put_stream([data], expected)

    def get(self, digest: str) -> bytes:
        """The whole blob, in memory: for callers in this process that use it whole anyway."""
        with self.open(digest) as f:
            return f.read()

    @abstractmethod
    def open(self, digest: str) -> BinaryIO:
        """The blob as a seekable binary file (NotFound if the store lacks it)."""

    @abstractmethod
    def size(self, digest: str) -> int:
        """The blob's length in bytes (NotFound if the store lacks it)."""

    @abstractmethod
    def exists(self, digest: str) -> bool: ...

    @abstractmethod
    def _commit(self, digest: str, written: Path) -> None:
        """Store the checked file ``written`` as blob ``digest`` (the caller removes ``written`` after)."""


class BlobUpload:
    """One blob arriving in chunks (``write``), stored by ``finish`` only if whole and right. Use as a
    context manager: leaving it, finished or not, removes the temporary file."""

    def __init__(self, store: BlobStore, expected: str | None, limit: int | None):
        self.expected = None if expected is None else validate_digest(expected)
        self.limit, self.size = limit, 0
        self._store, self._hash = store, hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=store.staging, prefix=".tmp-")
        self._tmp, self._file = Path(tmp), os.fdopen(fd, "wb")

    def write(self, chunk: bytes) -> None:
        """Hash and write ``chunk``; PayloadTooLarge as soon as the blob outgrows ``limit``."""
        self.size += len(chunk)
        if self.limit is not None and self.size > self.limit:
            raise PayloadTooLarge(f"the blob is larger than the store's limit of {self.limit} bytes")
        self._hash.update(chunk)
        self._file.write(chunk)

    def finish(self) -> str:
        """Store what was written under its sha256 (unless held already) and return it; BadRequest naming
        the real digest if it is not the one expected."""
        digest = self._hash.hexdigest()
        if self.expected is not None and digest != self.expected:
            raise BadRequest(f"blob content hashes to {digest}, not {self.expected}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if not self._store.exists(digest):
            self._store._commit(digest, self._tmp)
        return digest

    def __enter__(self) -> BlobUpload:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class LocalBlobStore(BlobStore):
    """Blobs as files under a directory, fanned out by the first two hex digits; uploads are written
    beside them (hidden names in the root) and renamed into place."""

    def __init__(self, root: Path):
        self.root = self.staging = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        validate_digest(digest)
        return self.root / digest[:2] / digest

    def check(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ServiceError(f"the blob directory {self.root} is not writable by this process")

    def exists(self, digest: str) -> bool:
        return self._path(digest).exists()

    def open(self, digest: str) -> BinaryIO:
        try:
            return self._path(digest).open("rb")
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def size(self, digest: str) -> int:
        try:
            return self._path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def _commit(self, digest: str, written: Path) -> None:
        path = self._path(digest)
        path.parent.mkdir(exist_ok=True)
        os.replace(written, path)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file beside it, synced and renamed into place: a reader (or a
    crash) sees the old file or the whole new one, never part of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
