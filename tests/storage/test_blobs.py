"""One suite for every blob store (``store`` in conftest.py: local directory, fsspec memory, S3)."""

import hashlib
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuflex.errors import BadRequest, NotFound, PayloadTooLarge
from gpuflex.storage import LocalBlobStore

# Examples share the test's store: each blob is named by its hash, so what one leaves another may meet.
SHARED_STORE = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


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


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` in chunks ending at ``cuts`` (empty chunks included, as a stream may send them)."""
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@SHARED_STORE
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_chunking_stores_the_same_blob(store, data, cuts):
    digest = hashlib.sha256(data).hexdigest()
    assert store.put_stream(_cut(data, cuts), expected=digest) == digest
    assert store.get(digest) == data


@SHARED_STORE
@given(
    data=st.binary(min_size=1, max_size=4096),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
    wrong=st.booleans(),
)
def test_a_wrong_or_oversized_stream_leaves_nothing_under_its_key(store, data, cuts, wrong):
    digest = hashlib.sha256(data).hexdigest()
    if wrong:
        claimed = hashlib.sha256(data + b"!").hexdigest()
        with pytest.raises(BadRequest, match=f"hashes to {digest}, not {claimed}"):
            store.put_stream(_cut(data, cuts), expected=claimed)
        assert not store.exists(claimed)
    else:
        with pytest.raises(PayloadTooLarge, match=f"limit of {len(data) - 1} bytes"):
            store.put_stream(_cut(data, cuts), expected=digest, limit=len(data) - 1)
    assert not store.exists(digest)
    if isinstance(store, LocalBlobStore):  # and no temporary file stays behind
        assert [p for p in store.root.rglob("*") if p.is_file()] == []


def test_an_oversized_stream_is_refused_as_its_bytes_arrive(store):
    def chunks():
        yield b"x" * 10
        yield b"y" * 10
        raise AssertionError("read past the limit")

    with pytest.raises(PayloadTooLarge):
        store.put_stream(chunks(), limit=15)


def test_a_blob_opens_as_a_seekable_file(store):
    data = bytes(range(256)) * 64
    digest = store.put(data)
    assert store.size(digest) == len(data)
    with store.open(digest) as f:
        assert f.seek(0, 2) == len(data)
        f.seek(1000)
        assert f.read(24) == data[1000:1024]
    for absent in (store.open, store.size):
        with pytest.raises(NotFound):
            absent("0" * 64)
