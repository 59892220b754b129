"""Blobs as objects under a URL of any fsspec filesystem: ``s3://bucket/prefix`` on AWS S3 or any
S3-compatible service (MinIO, Ceph, R2, ... through s3fs), or ``memory://`` for tests.

Several coordinator replicas share one store this way, where a local directory would need a shared
disk. An upload is spooled to a local temporary file until it checks out, then written as one object
(whole or not at all, so the bucket needs no temporary name); a read is a seekable file that fetches
ranges as it is read. Keys are laid out as the local store lays out files (``ab/abcd…``), so a blob
directory can be copied into a bucket as is.
Listings are never cached: another replica's write must be visible at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from gpuflex.errors import NotFound
from gpuflex.storage.blobs import BlobStore, validate_digest


class FsspecBlobStore(BlobStore):
    def __init__(self, url: str, **storage_options: Any):
        if url.startswith("s3://"):
            storage_options.setdefault("use_listings_cache", False)
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def _key(self, digest: str) -> str:
        validate_digest(digest)
        return f"{self.root}/{digest[:2]}/{digest}"

    def exists(self, digest: str) -> bool:
        return self.fs.exists(self._key(digest))

    def open(self, digest: str) -> BinaryIO:
        try:
            return self.fs.open(self._key(digest), "rb")
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def size(self, digest: str) -> int:
        try:
            return self.fs.size(self._key(digest))
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def _commit(self, digest: str, written: Path) -> None:
        self.fs.put_file(str(written), self._key(digest))
