"""``POST /v1/blobs/missing``: an upload asks which keys the store lacks and sends only those."""

import hashlib

import pytest

from gpuflex.client import Client
from gpuflex.errors import BadRequest, Unauthorized


def test_the_store_names_the_keys_it_lacks_and_its_blob_limit(coordinator):
    alice = coordinator.consumer("alice")
    held = alice.upload(b"already here")
    lacking = hashlib.sha256(b"not yet").hexdigest()
    answer = alice.missing_blobs([held, lacking, held, lacking])
    assert answer.keys == [lacking]
    assert answer.max_blob_bytes == coordinator.ctx.settings.max_blob_bytes
    alice.upload(b"not yet")
    assert alice.missing_blobs([held, lacking]).keys == []


def test_asking_needs_credentials_and_well_formed_keys(coordinator):
    with pytest.raises(Unauthorized):
        Client(coordinator.url).missing_blobs([])
    alice = coordinator.consumer("alice")
    with pytest.raises(BadRequest, match="keys"):
        alice.http.request("POST", "/v1/blobs/missing", json={"keys": ["../etc/passwd"]})
