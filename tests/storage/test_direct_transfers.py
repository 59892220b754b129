"""A coordinator on S3 (moto's server on loopback) signs URLs instead of carrying blob bytes: only for a
caller the usual rules let read or write the blob, and it counts what it signed for. The SDK follows
them without the API's credentials, and checks every read's sha256."""

import hashlib
import re
import threading

import httpx
import pytest
from moto.server import ThreadedMotoServer
from tests.coordinator.conftest import running_coordinator

from gpuflex.client import direct
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import HashMismatch, NotFound, ServiceError
from gpuflex.localnet import free_port
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage import FsspecBlobStore
from gpuflex.testing import blob_bytes

from .conftest import s3_options

CORPUS = b"corpus " * 2000
MODEL = b"\x01" * 4096


@pytest.fixture
def coordinator(tmp_path, s3_bucket, s3_endpoint):
    store = FsspecBlobStore(s3_bucket, **s3_options(s3_endpoint), skip_instance_cache=True)
    with running_coordinator(f"sqlite:///{tmp_path / 'gpuflex.db'}", tmp_path, blobs=store) as harness:
        yield harness


def test_blobs_and_checkpoints_move_by_signed_urls_and_never_through_the_coordinator(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    nodes = [coordinator.node("core", core=True, price=0.4), coordinator.node("c0")]
    spec = JobSpec.model_validate({"name": "m", "resources": {"workers": 1}, "training": {"rounds": 3}})
    job = alice.submit(spec, alice.upload(CORPUS))
    aggregator, worker = (coordinator.task(n.lease()) for n in nodes)
    state = aggregator.put_blob(MODEL)
    aggregator.publish_round(m.RoundPublish(round=0, state_hash="0" * 64, checkpoint=state, val_loss=5.0))
    assert worker.get_blob(state) == MODEL and nodes[1].get_blob(state) == MODEL
    assert alice.checkpoint(job.id) == MODEL
    assert aggregator.put_blob(MODEL) == state  # the store has it: nothing is signed, nothing sent
    assert blob_bytes(coordinator.url) == {
        "in": 0,
        "out": 0,
        "signed_in": len(CORPUS) + len(MODEL),
        "signed_out": 3 * len(MODEL),
    }


def test_a_url_is_signed_only_for_whoever_may_read_the_blob(coordinator):
    alice = coordinator.consumer("alice")
    digest = alice.upload(CORPUS)
    node = coordinator.node("n1")
    path = f"/v1/blobs/{digest}"
    answer = coordinator.http.get(path, headers=node.key.sign_request("GET", path, b""))
    assert answer.status_code == 307 and answer.headers["Cache-Control"] == "no-store"
    assert httpx.get(answer.headers["Location"]).content == CORPUS  # the URL alone is the credential
    consumer = coordinator.http.get(path, headers=alice.http._http.headers)
    assert consumer.status_code == 403 and "Location" not in consumer.headers
    assert "through their jobs" in consumer.json()["detail"]
    assert coordinator.http.get(path).status_code == 401
    assert blob_bytes(coordinator.url)["signed_out"] == len(CORPUS)  # the refused were signed nothing


def test_uploads_are_refused_over_the_limit_and_unless_the_store_hashed_them_to_their_key(coordinator):
    alice = coordinator.consumer("alice")
    auth = alice.http._http.headers
    digest = hashlib.sha256(CORPUS).hexdigest()
    ask = {"sha256": digest, "length": 256 * 1024 + 1}
    assert coordinator.http.post("/v1/blobs/uploads", json=ask).status_code == 401
    too_big = coordinator.http.post("/v1/blobs/uploads", json=ask, headers=auth)
    assert (
        too_big.status_code == 413 and "over this coordinator's limit of 262144" in too_big.json()["detail"]
    )
    ask = {"sha256": digest, "length": len(CORPUS)}
    ticket = m.UploadTicket.model_validate(
        coordinator.http.post("/v1/blobs/uploads", json=ask, headers=auth).json()
    )
    done = {"sha256": digest, "upload": ticket.upload}
    nothing = coordinator.http.post("/v1/blobs/uploads/done", json=done, headers=auth)
    assert nothing.status_code == 404 and "PUT it to the URL first" in nothing.json()["detail"]
    forged = CORPUS.replace(b"corpus", b"CORPUS")  # the length signed, other bytes
    assert (
        httpx.put(ticket.url, content=forged, headers=ticket.headers).status_code == 200
    )  # moto checks nothing
    refused = coordinator.http.post("/v1/blobs/uploads/done", json=done, headers=auth)
    assert refused.status_code == 400
    actual = hashlib.sha256(forged).hexdigest()
    why = f"upload of blob {digest} refused and deleted: the bytes sent hash to {actual}"
    assert refused.json()["detail"] == why
    assert not coordinator.ctx.blobs.exists(digest)
    assert blob_bytes(coordinator.url) == {"in": 0, "out": 0, "signed_in": len(CORPUS), "signed_out": 0}


def test_a_url_used_for_another_blob_is_caught_by_the_readers_hash(coordinator):
    alice = coordinator.consumer("alice")
    one, two = alice.upload(b"blob one"), alice.upload(b"blob two")
    url_of_two = coordinator.ctx.blobs.presign_get(two, 2e9).url
    with pytest.raises(HashMismatch, match=f"blob {one} arrived corrupted from the object store"):
        direct.fetch(url_of_two, one)


def test_a_coordinator_whose_store_cannot_be_reached_does_not_start(tmp_path):
    nowhere = s3_options(f"http://127.0.0.1:{free_port()}")
    settings = CoordinatorSettings(
        data_dir=tmp_path, blob_url="s3://gpuflex/blobs", blob_storage_options=nowhere
    )
    with pytest.raises(ServiceError, match="the blob store s3://gpuflex/blobs cannot be written"):
        create_app(settings)


def test_the_stores_refusal_is_one_error_with_its_own_reason(coordinator):
    digest = coordinator.consumer("alice").upload(b"soon gone")
    store = coordinator.ctx.blobs
    url = store.presign_get(digest, 2e9).url
    store.fs.rm_file(f"{store.root}/{digest[:2]}/{digest}")
    refused = (
        f"the object store refused the GET of blob {digest}: NoSuchKey: The specified key does not exist"
    )
    with pytest.raises(NotFound, match=refused):
        direct.fetch(url, digest, retry_for_s=5)  # a 4xx is an answer: not tried again


def test_a_store_out_of_reach_is_tried_again_for_as_long_as_the_caller_retries(coordinator):
    digest = coordinator.consumer("alice").upload(b"worth the wait")
    port = free_port()
    # moto checks no signature, so the URL may name a server that starts a second from now
    url = re.sub(
        r"//127\.0\.0\.1:\d+/", f"//127.0.0.1:{port}/", coordinator.ctx.blobs.presign_get(digest, 2e9).url
    )
    with pytest.raises(ServiceError, match=f"cannot reach the object store for blob {digest}"):
        direct.fetch(url, digest)
    later = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)  # the same buckets
    starting = threading.Timer(1.0, later.start)
    starting.start()
    try:
        assert direct.fetch(url, digest, retry_for_s=60) == b"worth the wait"
    finally:
        starting.join()
        later.stop()
