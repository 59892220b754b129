"""A real coordinator process carries a blob far larger than its memory should grow by: the upload and
the download stream, so its peak resident memory (the kernel's VmHWM) barely moves while 128 MiB pass
through it each way."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuflex.client import Client
from gpuflex.localnet import LocalNetwork
from gpuflex.testing import register_node

pytestmark = pytest.mark.integration

MIB = 1 << 20
BLOB_MIB = 128
GROWTH_LIMIT = 48 * MIB  # a few MiB a transfer, with room for the allocator; a buffered body is 128 MiB


def _chunks(salt: bytes) -> Iterator[bytes]:
    """The blob, 1 MiB at a time, never whole in the test's memory either."""
    for i in range(BLOB_MIB):
        yield hashlib.sha256(salt + i.to_bytes(4, "big")).digest() * (MIB // 32)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc: not Linux?")


def test_a_large_blob_streams_through_the_coordinator_in_bounded_memory(tmp_path):
    settings = {"GPUFLEX_MAX_BLOB_BYTES": str(2 * BLOB_MIB * MIB)}
    with LocalNetwork(tmp_path, settings=settings) as net:
        url = net.start_coordinator()
        alice = Client(url, Client(url).create_account("alice").token)
        node = register_node(url, "n1")
        warm = b"warm-up" * 100_000  # every code path of a transfer run once before the baseline
        assert node.get_blob(alice.upload(warm)) == warm
        baseline = _peak_rss(net.coordinator.pid)

        digest = hashlib.sha256(b"".join(_chunks(b"blob"))).hexdigest()
        put = httpx.put(
            f"{url}/v1/blobs/{digest}",
            content=_chunks(b"blob"),
            headers={"Authorization": alice.http._http.headers["Authorization"]},
            timeout=300,
        )
        assert put.status_code == 201, put.text
        after_upload = _peak_rss(net.coordinator.pid)

        received = hashlib.sha256()
        with node.http.stream("GET", f"/v1/blobs/{digest}") as response:
            for chunk in response.iter_bytes():
                received.update(chunk)
        assert received.hexdigest() == digest
        after_download = _peak_rss(net.coordinator.pid)

    print(
        f"coordinator peak RSS: {baseline / MIB:.0f} MiB at rest, +{(after_upload - baseline) / MIB:.1f} MiB "
        f"after a {BLOB_MIB} MiB upload, +{(after_download - after_upload) / MIB:.1f} MiB after its download"
    )
    assert after_upload - baseline < GROWTH_LIMIT
    assert after_download - after_upload < GROWTH_LIMIT
