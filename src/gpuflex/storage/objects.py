"""Blobs as objects under a URL of any fsspec filesystem: ``s3://bucket/prefix`` on AWS S3 or any
S3-compatible service (MinIO, Ceph, R2, ... through s3fs), or ``memory://`` for tests.

Several coordinator replicas share one store this way, where a local directory would need a shared
disk. An upload is spooled to a local temporary file until it checks out, then written as one object
(whole or not at all, so the bucket needs no temporary name); a read is a seekable file that fetches
ranges as it is read. Keys are laid out as the local store lays out files (``ab/abcd…``), so a blob
directory can be copied into a bucket as is.
Listings are never cached: another replica's write must be visible at once.

On S3 the coordinator signs URLs instead of carrying bytes (SigV4: a signature covers the key, the
method, the expiry and the signed headers). A presigned PUT lands under ``uploads/<digest>/<upload>``,
never under the blob's key, and bears its length and sha256 as signed headers, which S3 checks; a
service that does not check them (moto does not) is caught by ``commit_upload``, which has the store
hash the staged object itself (a server-side copy with ``ChecksumAlgorithm``) and only then copies it
under the blob's key. Staged objects nobody commits are left for a lifecycle rule on ``uploads/``.
"""

from __future__ import annotations

import base64
import re
import secrets
import time
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from gpuflex.errors import BadRequest, NotFound, ServiceError
from gpuflex.storage.blobs import BlobStore, Presigned, validate_digest

# length.expires_at.nonce, as ``presign_put`` names an upload: the coordinator chose each part
_UPLOAD = re.compile(r"^(\d+)\.(\d+)\.[0-9a-f]{32}$")
# an upload begun before its URL expired may end after it, and the store's clock is not ours
UPLOAD_GRACE_S = 300


class FsspecBlobStore(BlobStore):
    def __init__(self, url: str, **storage_options: Any):
        self.url = url
        self.signs_urls = url.startswith("s3://")
        if self.signs_urls:
            storage_options.setdefault("use_listings_cache", False)
            # SigV4, so a presigned PUT's signature covers its Content-Length and x-amz-checksum-sha256
            config = storage_options.get("config_kwargs", {})
            storage_options["config_kwargs"] = {"signature_version": "s3v4", **config}
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def _key(self, digest: str) -> str:
        validate_digest(digest)
        return f"{self.root}/{digest[:2]}/{digest}"

    def _staged(self, digest: str, upload: str) -> str:
        return f"{self.root}/uploads/{validate_digest(digest)}/{upload}"

    def check(self) -> None:
        probe = f"{self.root}/.gpuflex-probe"
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as err:  # whatever the filesystem raises, the operator needs its words
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ServiceError(f"the blob store {self.url} cannot be written: {reason}") from None

    def exists(self, digest: str) -> bool:
        return self.fs.exists(self._key(digest))

    def open(self, digest: str) -> BinaryIO:
        try:
            return self.fs.open(self._key(digest), "rb")
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def size(self, digest: str) -> int:
        try:
            return self.fs.info(self._key(digest))["size"]
        except FileNotFoundError:
            raise NotFound(f"no blob {digest}") from None

    def _commit(self, digest: str, written: Path) -> None:
        self.fs.put_file(str(written), self._key(digest))

    def presign_get(self, digest: str, expires_at: float) -> Presigned | None:
        if not self.signs_urls:
            return None
        length = self.size(digest)
        url = self.fs.url(self._key(digest), expires=_seconds_until(expires_at))
        return Presigned(url, int(expires_at), length)

    def presign_put(self, digest: str, length: int, expires_at: float) -> Presigned | None:
        if not self.signs_urls:
            return None
        upload = f"{length}.{int(expires_at)}.{secrets.token_hex(16)}"
        checksum = base64.b64encode(bytes.fromhex(validate_digest(digest))).decode()
        url = self.fs.url(
            self._staged(digest, upload),
            expires=_seconds_until(expires_at),
            client_method="put_object",
            ContentLength=length,
            ChecksumSHA256=checksum,
        )
        headers = {"Content-Length": str(length), "x-amz-checksum-sha256": checksum}
        return Presigned(url, int(expires_at), length, headers, upload)

    def commit_upload(self, digest: str, upload: str) -> None:
        if not self.signs_urls:
            return super().commit_upload(digest, upload)
        if not _UPLOAD.fullmatch(upload):
            raise BadRequest(f"{upload!r} is not an upload this coordinator signed")
        staged = self._staged(digest, upload)
        try:
            info = self.fs.info(staged)
        except FileNotFoundError:
            raise NotFound(f"nothing was uploaded for blob {digest}: PUT it to the URL first") from None
        try:
            problem = self._upload_problem(digest, upload, staged, info)
            if problem:
                raise BadRequest(f"upload of blob {digest} refused and deleted: {problem}")
            if not self.exists(digest):
                self.fs.copy(staged, self._key(digest))
        finally:
            self.fs.rm_file(staged)

    def _upload_problem(self, digest: str, upload: str, staged: str, info: dict) -> str | None:
        """Why a staged upload is not blob ``digest`` as signed for, or None: checked by the store's own
        sha256 of the bytes, not by any header the uploader sent."""
        length, expires_at = (int(part) for part in _UPLOAD.fullmatch(upload).groups())
        if info["LastModified"].timestamp() > expires_at + UPLOAD_GRACE_S:
            return f"it arrived after its URL expired at {expires_at} (Unix time)"
        if info["size"] != length:
            return f"{info['size']} bytes were sent where {length} were signed for"
        bucket, key, _ = self.fs.split_path(staged)
        copied = self.fs.call_s3(
            "copy_object",
            Bucket=bucket,
            Key=key,
            CopySource={"Bucket": bucket, "Key": key},
            MetadataDirective="REPLACE",
            ChecksumAlgorithm="SHA256",
        )
        actual = base64.b64decode(copied["CopyObjectResult"]["ChecksumSHA256"]).hex()
        return None if actual == digest else f"the bytes sent hash to {actual}"


def _seconds_until(expires_at: float) -> int:
    """A URL's life in whole seconds, at least one (S3 takes no less)."""
    return max(1, int(expires_at - time.time()))
