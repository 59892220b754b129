"""Every blob store the project ships, for one shared suite: the local directory, fsspec's memory
filesystem, and S3 — a real S3-compatible endpoint (moto's server mode) started on loopback."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest

from gpuflex.localnet import free_port
from gpuflex.storage import BlobStore, FsspecBlobStore, LocalBlobStore


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 for the session (moto, from the dev extra)."""
    missing = "moto[server] is not installed (pip install -e '.[dev]')"
    server_module = pytest.importorskip("moto.server", reason=missing)
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[s3]')")
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict:
    """What a coordinator's ``blob_storage_options`` would say for this endpoint (moto takes any key)."""
    return {"endpoint_url": endpoint, "key": "test", "secret": "test"}


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh bucket on the endpoint; returns its s3:// URL with a prefix, as an operator would give it."""
    import s3fs

    bucket = f"gpuflex-{secrets.token_hex(4)}"
    s3fs.S3FileSystem(**s3_options(s3_endpoint)).mkdir(bucket)
    return f"s3://{bucket}/blobs"


@pytest.fixture(params=["local", "memory", "s3"])
def open_store(request, tmp_path) -> Callable[[], BlobStore]:
    """Opens the store, anew at each call on the same place, as each coordinator replica would."""
    if request.param == "local":
        return lambda: LocalBlobStore(tmp_path / "blobs")
    if request.param == "memory":
        return lambda: FsspecBlobStore(f"memory://{tmp_path.name}/blobs")
    url, options = request.getfixturevalue("s3_bucket"), s3_options(request.getfixturevalue("s3_endpoint"))
    return lambda: FsspecBlobStore(url, **options, skip_instance_cache=True)


@pytest.fixture
def store(open_store) -> BlobStore:
    return open_store()
