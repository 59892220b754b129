"""A task's shards: opened once, only when asked for, through the node's cache, every one checked."""

from __future__ import annotations

import threading

import pytest

from gpuflex.data.cache import ShardCache
from gpuflex.data.fetch import FetchedShards, LocalShards
from gpuflex.data.manifest import read_manifest
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import Source
from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.errors import HashMismatch
from gpuflex.storage.fetching import FETCH_WORKERS
from gpuflex.testing import CountingBlobs


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "d.txt").write_text(" ".join(str(i) for i in range(300)))  # no two shards alike
    out = tmp_path / "out"
    prepare(Source([str(tmp_path / "d.txt")]), load_tokenizer(None), out, shard_tokens=300, val_tokens=150)
    return out


def served(directory, bad: int = 0) -> CountingBlobs:
    """The prepared dataset's shards as the coordinator serves them."""
    manifest = read_manifest(directory)
    shards = manifest.train + manifest.validation
    return CountingBlobs({s.sha256: (directory / s.file).read_bytes() for s in shards}, bad)


def test_shards_are_fetched_once_per_node_and_a_second_job_reads_them_from_the_cache(prepared, tmp_path):
    manifest = read_manifest(prepared)
    store, cache = served(prepared), ShardCache(tmp_path / "cache", limit_bytes=10_000)
    first = FetchedShards(store.fetch, cache)
    tokens = first.open(manifest.train[1], manifest.dtype)
    assert first.open(manifest.train[1], manifest.dtype) is tokens  # opened once per process
    assert tokens.tolist() == LocalShards(prepared).open(manifest.train[1], manifest.dtype).tolist()
    assert store.fetched == [manifest.train[1].sha256] and first.opened == ["train-00001.bin"]
    second = FetchedShards(store.fetch, cache)  # another job's task on the same node
    assert second.open(manifest.train[1], manifest.dtype).tolist() == tokens.tolist()
    assert store.fetched == [manifest.train[1].sha256]  # nothing fetched again
    assert cache.get(manifest.train[0].sha256) is None  # and nothing it was not asked for


def test_a_corrupted_fetch_is_fetched_again_and_a_second_one_fails_naming_the_shard(prepared, tmp_path):
    manifest = read_manifest(prepared)
    shard = manifest.validation[0]
    once = served(prepared, bad=1)
    assert (
        len(FetchedShards(once.fetch, ShardCache(tmp_path / "c1", 10_000)).open(shard, manifest.dtype)) == 150
    )
    assert once.fetched == [shard.sha256] * 2
    twice = served(prepared, bad=2)
    with pytest.raises(
        HashMismatch, match=rf"shard validation-00000.bin arrived corrupted 2 times .*{shard.sha256}"
    ):
        FetchedShards(twice.fetch).open(shard, manifest.dtype)


def test_a_cached_shard_damaged_on_disk_is_fetched_again(prepared, tmp_path):
    manifest = read_manifest(prepared)
    shard = manifest.train[0]
    store, cache = served(prepared), ShardCache(tmp_path / "cache", limit_bytes=10_000)
    FetchedShards(store.fetch, cache).open(shard, manifest.dtype)
    path = cache.get(shard.sha256)
    path.write_bytes(b"\0" * path.stat().st_size)  # another task, or the disk, spoilt it
    assert FetchedShards(store.fetch, cache).open(shard, manifest.dtype).tolist()[:3] == [48, 32, 49]  # '0 1'
    assert store.fetched == [shard.sha256] * 2


def test_shards_asked_for_together_are_fetched_at_once_each_once_and_given_in_order(prepared, tmp_path):
    manifest = read_manifest(prepared)
    shards = (manifest.train + manifest.validation)[:FETCH_WORKERS]
    store = served(prepared)
    together = threading.Barrier(len(shards), timeout=30)  # broken unless every fetch runs at once

    def fetch(digest: str) -> bytes:
        together.wait()
        return store.fetch(digest)

    reader = FetchedShards(fetch, ShardCache(tmp_path / "cache", limit_bytes=10_000))
    asked = [*shards, shards[0]]
    opened = reader.open_all(asked, manifest.dtype)
    assert [t.tolist() for t in opened] == [
        LocalShards(prepared).open(s, manifest.dtype).tolist() for s in asked
    ]
    assert sorted(store.fetched) == sorted(s.sha256 for s in shards)  # each once
    assert reader.opened == [s.file for s in shards]
