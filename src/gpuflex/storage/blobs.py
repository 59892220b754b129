"""Blobs are immutable and named by their sha256, so any copy can be checked and nothing is overwritten.

A key is exactly 64 lower-case hex digits; anything else (``../``, slashes, upper case) is refused
before it can reach a path. Writes go to a temporary file first and are renamed into place, so
a crash never leaves a half-written blob under a valid name.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from gpuflex.errors import BadRequest, NotFound, ServiceError

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

    def put(self, data: bytes, expected: str | None = None) -> str:
        """Store ``data``; if ``expected`` is given, refuse data whose hash differs."""
        digest = sha256_hex(data)
        if expected is not None and validate_digest(expected) != digest:
            raise BadRequest(f"blob content hashes to {digest}, not {expected}")
        if not self.exists(digest):
            self._write(digest, data)
        return digest

    @abstractmethod
    def get(self, digest: str) -> bytes: ...

    @abstractmethod
    def exists(self, digest: str) -> bool: ...

    @abstractmethod
    def size(self, digest: str) -> int:
        """The blob's length in bytes, without reading it (``NotFound`` if absent)."""

    @abstractmethod
    def _write(self, digest: str, data: bytes) -> None: ...


class LocalBlobStore(BlobStore):
    """Blobs as files under a directory, fanned out by the first two hex digits."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        validate_digest(digest)
        return self.root / digest[:2] / digest

    def check(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ServiceError(f"the blob directory {self.root} is not writable by this process")

    def exists(self, digest: str) -> bool:
        return self._path(digest).exists()

    def get(self, digest: str) -> bytes:
        try:
            return self._path(digest).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def size(self, digest: str) -> int:
        try:
            return self._path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def _write(self, digest: str, data: bytes) -> None:
        path = self._path(digest)
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, data)


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
