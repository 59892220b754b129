"""Presigned URLs on S3 (moto's server on loopback): readers and writers move bytes to and from the
store themselves, and an upload becomes a blob only once the store's own sha256 of it equals its key."""

import hashlib
import time

import httpx
import pytest

from gpuflex.errors import BadRequest, NotFound, ServiceError
from gpuflex.localnet import free_port
from gpuflex.storage import FsspecBlobStore, LocalBlobStore

from .conftest import s3_options

HOUR = 3600


@pytest.fixture
def s3_store(s3_bucket, s3_endpoint) -> FsspecBlobStore:
    return FsspecBlobStore(s3_bucket, **s3_options(s3_endpoint), skip_instance_cache=True)


def _upload(store: FsspecBlobStore, digest: str, body: bytes, *, length: int, expires_at: float) -> str:
    """PUT ``body`` to a URL signed for ``digest`` and ``length``, as a client would; the upload's name."""
    signed = store.presign_put(digest, length, expires_at)
    headers = {**signed.headers, "Content-Length": str(len(body))}  # a liar's length, where it lies
    response = httpx.put(signed.url, content=body, headers=headers)
    assert response.status_code == 200, response.text
    return signed.upload


def _staged(store: FsspecBlobStore, digest: str) -> list[str]:
    return store.fs.find(f"{store.root}/uploads/{digest}")


def test_a_presigned_get_serves_the_blob_and_a_missing_blob_is_not_signed(s3_store):
    digest = s3_store.put(b"weights")
    signed = s3_store.presign_get(digest, time.time() + HOUR)
    assert signed.length == len(b"weights")
    assert httpx.get(signed.url).content == b"weights"  # no credentials but the URL's
    with pytest.raises(NotFound):
        s3_store.presign_get("0" * 64, time.time() + HOUR)


def test_a_presigned_put_becomes_the_blob_once_committed(s3_store):
    data = b"a pseudo-gradient"
    digest = hashlib.sha256(data).hexdigest()
    upload = _upload(s3_store, digest, data, length=len(data), expires_at=time.time() + HOUR)
    assert not s3_store.exists(digest)  # staged, not yet under its key
    s3_store.commit_upload(digest, upload)
    assert s3_store.get(digest) == data and _staged(s3_store, digest) == []


@pytest.mark.parametrize(
    ("body", "expires_in", "reason"),
    [
        (b"other bytes, same size", HOUR, "the bytes sent hash to"),
        (b"not the length", HOUR, "bytes were sent where 22 were signed for"),
        (b"the signed bytes here!", -HOUR, "after its URL expired"),
    ],
)
def test_an_upload_that_is_not_what_was_signed_is_refused_and_deleted(s3_store, body, expires_in, reason):
    signed_for = b"the signed bytes here!"
    digest = hashlib.sha256(signed_for).hexdigest()
    upload = _upload(s3_store, digest, body, length=len(signed_for), expires_at=time.time() + expires_in)
    with pytest.raises(BadRequest, match=reason):
        s3_store.commit_upload(digest, upload)
    assert not s3_store.exists(digest) and _staged(s3_store, digest) == []  # nothing under any key


def test_an_upload_is_only_committed_for_the_key_it_was_signed_for(s3_store):
    data, other = b"blob one", hashlib.sha256(b"blob two").hexdigest()
    digest = hashlib.sha256(data).hexdigest()
    upload = _upload(s3_store, digest, data, length=len(data), expires_at=time.time() + HOUR)
    with pytest.raises(NotFound, match="nothing was uploaded"):
        s3_store.commit_upload(other, upload)
    for forged in ("../../" + upload, f"{len(data)}.9999999999.x", ""):
        with pytest.raises(BadRequest, match="not an upload this coordinator signed"):
            s3_store.commit_upload(digest, forged)
    assert not s3_store.exists(other) and not s3_store.exists(digest)


def test_stores_that_cannot_sign_urls_say_so(tmp_path):
    for store in (LocalBlobStore(tmp_path / "blobs"), FsspecBlobStore(f"memory://{tmp_path.name}/blobs")):
        digest = store.put(b"x")
        assert store.presign_get(digest, time.time() + HOUR) is None
        assert store.presign_put(digest, 1, time.time() + HOUR) is None
        with pytest.raises(BadRequest, match="through the coordinator"):
            store.commit_upload(digest, f"1.{int(time.time())}.{'0' * 32}")


def test_a_store_that_cannot_be_reached_or_written_is_one_clear_error(s3_endpoint):
    nowhere = s3_options(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServiceError, match=r"the blob store s3://gpuflex/blobs cannot be written: Could not"):
        FsspecBlobStore("s3://gpuflex/blobs", **nowhere, skip_instance_cache=True).check()
    no_bucket = FsspecBlobStore("s3://no-such-bucket/blobs", **s3_options(s3_endpoint))
    with pytest.raises(ServiceError, match="s3://no-such-bucket/blobs cannot be written"):
        no_bucket.check()
