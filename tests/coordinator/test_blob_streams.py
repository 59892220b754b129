"""Blobs stream through the coordinator: ranges of a download (206, 416), an upload refused as it
arrives (413 past the limit, 400 for a wrong hash) leaving nothing behind, a node's signed upload
checked before its body is read, and a download cut off mid-body resumed from where it stopped."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import threading

import pytest

from gpuflex.client import NodeClient
from gpuflex.client.http import RESUMES
from gpuflex.errors import ServiceError
from gpuflex.testing import wait_for

from .conftest import running_coordinator

BLOB = bytes(range(256)) * 40  # 10,240 bytes
DIGEST = hashlib.sha256(BLOB).hexdigest()
PATH = f"/v1/blobs/{DIGEST}"


@pytest.fixture
def coordinator(tmp_path):
    """The blob routes read no table but their callers': one database is enough."""
    with running_coordinator(f"sqlite:///{tmp_path / 'gpuflex.db'}", tmp_path) as harness:
        yield harness


@pytest.fixture
def reader(coordinator):
    """Raw GETs of the blob as a signed node, with whatever Range header a test sends."""
    coordinator.consumer("alice").upload(BLOB)
    node = coordinator.node("n1")

    def get(range_: str | None = None):
        headers = node.key.sign_request("GET", PATH, b"") | ({"Range": range_} if range_ else {})
        return coordinator.http.get(PATH, headers=headers)

    return get


def _bytes_out(coordinator) -> float:
    text = coordinator.http.get("/metrics").text
    return float(re.search(r"^gpuflex_blob_bytes_out_total (\S+)$", text, re.MULTILINE).group(1))


def test_a_whole_download_says_its_length_and_that_it_takes_ranges(coordinator, reader):
    response = reader()
    assert response.status_code == 200 and response.content == BLOB
    assert response.headers["content-length"] == str(len(BLOB))
    assert response.headers["accept-ranges"] == "bytes"
    assert "content-range" not in response.headers


@pytest.mark.parametrize(
    ("range_", "start", "stop"),
    [
        ("bytes=10-19", 10, 20),
        ("bytes=10000-", 10000, len(BLOB)),
        ("bytes=-5", len(BLOB) - 5, len(BLOB)),
        ("bytes=-99999", 0, len(BLOB)),  # a suffix longer than the blob: all of it
        ("bytes=10230-99999", 10230, len(BLOB)),  # an end past the blob's: cut at it
        (f"bytes={len(BLOB) - 1}-", len(BLOB) - 1, len(BLOB)),
    ],
)
def test_a_range_is_sent_alone_and_counted_alone(coordinator, reader, range_, start, stop):
    before = _bytes_out(coordinator)
    response = reader(range_)
    assert response.status_code == 206, response.status_code
    assert response.content == BLOB[start:stop]
    assert response.headers["content-range"] == f"bytes {start}-{stop - 1}/{len(BLOB)}"
    assert response.headers["content-length"] == str(stop - start)
    assert _bytes_out(coordinator) - before == stop - start


@pytest.mark.parametrize("range_", ["bytes=20-10", "items=0-9", "bytes=0-1,5-6", "bytes=-", "bytes=x-1"])
def test_a_range_header_that_is_not_one_byte_range_is_ignored(reader, range_):
    response = reader(range_)
    assert response.status_code == 200 and response.content == BLOB


@pytest.mark.parametrize(
    "range_", [f"bytes={len(BLOB)}-", f"bytes={len(BLOB) + 5}-{len(BLOB) + 9}", "bytes=-0"]
)
def test_a_range_past_the_end_is_416(coordinator, reader, range_):
    before = _bytes_out(coordinator)
    response = reader(range_)
    assert response.status_code == 416, response.status_code
    assert "range" in response.json()["detail"]
    assert _bytes_out(coordinator) == before


def _chunks(data: bytes, size: int = 4096):
    """A body httpx sends chunked, with no Content-Length: the limit must be found as it streams."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _stored_files(coordinator) -> list:
    root = coordinator.ctx.settings.data_dir / "blobs"
    return sorted(p.name for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("chunked", [True, False])
def test_an_upload_past_the_limit_is_413_and_leaves_nothing(coordinator, chunked):
    auth = coordinator.consumer("alice").http._http.headers
    before = _stored_files(coordinator)
    big = b"z" * (coordinator.ctx.settings.max_blob_bytes + 1)
    path = f"/v1/blobs/{hashlib.sha256(big).hexdigest()}"
    response = coordinator.http.put(path, content=_chunks(big) if chunked else big, headers=auth)
    assert response.status_code == 413, response.text
    # No blob, and no temporary file once the route has unwound (the limit answers before it does).
    wait_for(lambda: _stored_files(coordinator) == before, 10, "the upload's temporary file removed")


def test_an_upload_that_hashes_to_another_key_is_400_naming_its_hash_and_leaves_nothing(coordinator):
    auth = coordinator.consumer("alice").http._http.headers
    before = _stored_files(coordinator)
    claimed = hashlib.sha256(b"something else").hexdigest()
    response = coordinator.http.put(f"/v1/blobs/{claimed}", content=_chunks(BLOB), headers=auth)
    assert response.status_code == 400
    assert response.json()["detail"] == f"blob content hashes to {DIGEST}, not {claimed}"
    assert _stored_files(coordinator) == before
    assert not coordinator.ctx.blobs.exists(claimed) and not coordinator.ctx.blobs.exists(DIGEST)


def test_a_node_signs_an_upload_whose_body_must_then_hash_to_its_key(coordinator):
    node = coordinator.node("n1")
    signed = node.key.sign_request("PUT", PATH, BLOB)
    assert coordinator.http.put(PATH, content=_chunks(BLOB), headers=signed).status_code == 201
    assert coordinator.ctx.blobs.get(DIGEST) == BLOB
    other = b"not the signed body"
    path = f"/v1/blobs/{hashlib.sha256(other).hexdigest()}"
    forged = node.key.sign_request("PUT", path, BLOB)  # a signature over another body than the key's
    response = coordinator.http.put(path, content=other, headers=forged)
    assert response.status_code == 401 and "signature" in response.json()["detail"]
    assert not coordinator.ctx.blobs.exists(hashlib.sha256(other).hexdigest())


class CuttingProxy:
    """A loopback TCP proxy to the coordinator that closes its first ``cuts`` connections once it has
    passed ``after`` bytes of the answer, as a dropped link ends a download; it keeps what each
    connection asked (its request bytes) and how many answer bytes it passed."""

    def __init__(self, target: str, *, after: int, cuts: int = 1):
        self.target = target.removeprefix("http://").split(":")
        self.after, self.cuts = after, cuts
        self.asked: list[bytes] = []
        self.passed: list[int] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                upstream = socket.create_connection((self.target[0], int(self.target[1])))
                index = len(self.asked)
                self.asked.append(b"")
                self.passed.append(0)
                threading.Thread(target=self._ask, args=(client, upstream, index), daemon=True).start()
                threading.Thread(target=self._answer, args=(upstream, client, index), daemon=True).start()

    def _ask(self, client: socket.socket, upstream: socket.socket, index: int) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                self.asked[index] += data
                upstream.sendall(data)

    def _answer(self, upstream: socket.socket, client: socket.socket, index: int) -> None:
        limit = self.after if index < self.cuts else None
        with contextlib.suppress(OSError), client, upstream:
            while data := upstream.recv(65536):
                if limit is not None:
                    data = data[: limit - self.passed[index]]
                client.sendall(data)
                self.passed[index] += len(data)
                if limit is not None and self.passed[index] >= limit:
                    for end in (client, upstream):  # shut down, not just closed: a reader blocked on
                        end.shutdown(socket.SHUT_RDWR)  # the socket in another thread would keep it open
                    return


def test_an_interrupted_download_resumes_where_it_stopped(coordinator):
    blob = os.urandom(2 << 20)
    coordinator.ctx.blobs.put(blob)
    node = coordinator.node("n1")
    proxy = CuttingProxy(coordinator.url, after=1 << 20)
    try:
        fetched = NodeClient(proxy.url, node.key).get_blob(hashlib.sha256(blob).hexdigest())
    finally:
        proxy.close()
    assert fetched == blob
    assert len(proxy.asked) == 2, "one cut, one resume"
    assert b"range:" not in proxy.asked[0].lower()
    (resumed_from,) = re.findall(rb"(?i)^range: bytes=(\d+)-\r$", proxy.asked[1], re.MULTILINE)
    assert 0 < int(resumed_from) < len(blob)
    # The resumed answer carries the rest alone: its headers and the bytes not yet received.
    assert len(blob) - int(resumed_from) <= proxy.passed[1] < len(blob) - int(resumed_from) + 1024


def test_a_download_cut_off_every_time_gives_up_saying_so(coordinator):
    coordinator.ctx.blobs.put(BLOB)
    node = coordinator.node("n1")
    proxy = CuttingProxy(coordinator.url, after=1000, cuts=100)
    try:
        with pytest.raises(ServiceError, match=f"cut off {RESUMES + 1} times"):
            NodeClient(proxy.url, node.key).get_blob(DIGEST)
    finally:
        proxy.close()
    assert len(proxy.asked) == RESUMES + 1
