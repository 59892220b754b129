"""One suite for every blob store (``store`` in conftest.py: local directory, fsspec memory, S3)."""

import hashlib

import pytest

from gpuflex.errors import BadRequest, NotFound


def test_put_then_get_by_hash(store):
    digest = store.put(b"hello")
    assert digest == hashlib.sha256(b"hello").hexdigest()
    assert store.get(digest) == b"hello" and store.exists(digest)
    assert store.put(b"hello") == digest  # idempotent


def test_a_wrong_expected_hash_is_refused_and_nothing_is_stored(store):
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(BadRequest, match="hashes to"):
        store.put(b"hello", expected=wrong)
    assert not store.exists(hashlib.sha256(b"hello").hexdigest())


@pytest.mark.parametrize(
    "key",
    [
        "../../etc/passwd",
        "%2e%2e%2fsecret",
        "..",
        "a" * 63,
        "A" * 64,
        "/" + "a" * 63,
        "g" * 64,
        "a" * 64 + "\n",
    ],
)
def test_keys_that_are_not_sha256_never_reach_a_path(store, key):
    with pytest.raises(BadRequest):
        store.get(key)


def test_missing_blob_is_not_found(store):
    with pytest.raises(NotFound):
        store.get("0" * 64)
    with pytest.raises(NotFound):
        store.size("0" * 64)


def test_a_size_is_told_without_reading_the_blob(store):
    assert store.size(store.put(b"twelve bytes")) == 12


def test_what_one_replica_writes_another_reads_at_once(open_store):
    first, second = open_store(), open_store()
    digest = hashlib.sha256(b"written by replica one").hexdigest()
    assert not second.exists(digest)  # asked before: a cached "no" must not outlive the write
    first.put(b"written by replica one")
    assert second.exists(digest) and second.get(digest) == b"written by replica one"
