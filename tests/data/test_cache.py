"""The shard cache: checked puts, LRU eviction within the limit, pins that hold (across processes too)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpuflex.data.cache import ShardCache
from gpuflex.errors import Conflict, HashMismatch


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(i: int, size: int = 10) -> bytes:
    return str(i).encode().ljust(size, b".")


def test_a_put_is_checked_against_its_hash_and_nothing_is_kept_when_it_fails(tmp_path):
    cache = ShardCache(tmp_path, limit_bytes=100)
    with pytest.raises(
        HashMismatch, match=f"the bytes fetched for {sha(b'x')} hash to {sha(b'y')}: not cached"
    ):
        cache.put(sha(b"x"), b"y")
    assert cache.size() == 0 and cache.get(sha(b"x")) is None and os.listdir(tmp_path / "blobs") == []
    path = cache.put(sha(b"x"), b"x")
    assert path.read_bytes() == b"x" and cache.get(sha(b"x")) == path and cache.size() == 1


def test_the_least_recently_used_blob_goes_first(tmp_path):
    cache = ShardCache(tmp_path, limit_bytes=30)
    a, b, c, d = (blob(i) for i in range(4))
    for data in (a, b, c):
        cache.put(sha(data), data)
    cache.get(sha(a))  # a is now used more recently than b
    cache.put(sha(d), d)
    assert cache.get(sha(b)) is None
    assert all(cache.get(sha(x)) for x in (a, c, d)) and cache.size() == 30


def test_a_pinned_blob_is_never_evicted_and_a_cache_full_of_pins_refuses(tmp_path):
    cache = ShardCache(tmp_path, limit_bytes=20)
    a, b, c = blob(0), blob(1), blob(2)
    with cache.pin(sha(a)), cache.pin(sha(b)):
        cache.put(sha(a), a)
        cache.put(sha(b), b)
        with pytest.raises(Conflict, match="cannot take 10 more bytes within its limit of 20: 20 are held"):
            cache.put(sha(c), c)
        assert cache.get(sha(c)) is None
    cache.put(sha(c), c)  # the pins released: room is made
    assert cache.size() == 20 and cache.get(sha(c))
    with pytest.raises(Conflict, match="a blob of at least 21 bytes does not fit a cache of 20"):
        cache.put(sha(blob(3, 21)), blob(3, 21))


class CacheMachine(RuleBasedStateMachine):
    """Random puts, gets, pins and releases: the limit always holds and no pinned blob ever goes."""

    LIMIT = 100

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp())
        self.cache = ShardCache(self.root, self.LIMIT)
        self.blobs: dict[str, bytes] = {}
        self.pins: dict[str, object] = {}
        self.kept: set[str] = set()  # pinned and held at the last check

    def pinned_held(self) -> set[str]:
        return {d for d in self.pins if (self.root / "blobs" / d).exists()}

    @rule(data=st.binary(min_size=1, max_size=45))
    def put(self, data):
        digest = sha(data)
        self.blobs[digest] = data
        held = digest in {p.name for p in (self.root / "blobs").iterdir()}
        pinned = sum(len(self.blobs[d]) for d in self.pinned_held() if d != digest)
        try:
            assert self.cache.put(digest, data).read_bytes() == data
            assert held or pinned + len(data) <= self.LIMIT
        except Conflict:
            assert not held and pinned + len(data) > self.LIMIT

    @precondition(lambda self: self.blobs)
    @rule(data=st.data())
    def pin(self, data):
        digest = data.draw(st.sampled_from(sorted(self.blobs)))
        if digest not in self.pins:
            self.pins[digest] = self.cache.pin(digest)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def release(self, data):
        self.pins.pop(data.draw(st.sampled_from(sorted(self.pins)))).release()

    @precondition(lambda self: self.blobs)
    @rule(data=st.data())
    def get(self, data):
        digest = data.draw(st.sampled_from(sorted(self.blobs)))
        path = self.cache.get(digest)
        assert path is None or path.read_bytes() == self.blobs[digest]

    @invariant()
    def within_the_limit_and_pins_kept(self):
        assert self.cache.size() <= self.LIMIT
        assert self.kept & self.pins.keys() <= self.pinned_held(), "a pinned blob was evicted"
        self.kept = self.pinned_held()

    def teardown(self):
        for pin in self.pins.values():
            pin.release()
        shutil.rmtree(self.root)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


WORKER = textwrap.dedent(
    """
    import hashlib, sys, time
    from pathlib import Path
    from gpuflex.data.cache import ShardCache
    from gpuflex.errors import Conflict
    cache = ShardCache(Path(sys.argv[1]), limit_bytes=int(sys.argv[2]))
    if sys.argv[3] == "pin":
        data = b"pinned by another process"
        digest = hashlib.sha256(data).hexdigest()
        pin = cache.pin(digest)
        cache.get(digest) or cache.put(digest, data)
        Path(sys.argv[4]).touch()
        time.sleep(60)
    for i in range(200):
        data = f"{sys.argv[3]}-{i}".encode() * 20
        digest = hashlib.sha256(data).hexdigest()
        with cache.pin(digest):
            try:
                path = cache.get(digest) or cache.put(digest, data)
            except Conflict:
                continue
            assert path.read_bytes() == data
    """
)


def test_processes_share_one_cache_and_a_pin_lasts_as_long_as_its_process(tmp_path):
    root, limit, ready = tmp_path / "cache", 2000, tmp_path / "ready"

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(limit), *args])

    holder = start("pin", str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert holder.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    pinned = sha(b"pinned by another process")
    workers = [start("a"), start("b")]
    assert [w.wait(timeout=120) for w in workers] == [0, 0]
    cache = ShardCache(root, limit)
    assert (root / "blobs" / pinned).exists() and cache.size() <= limit
    for path in (root / "blobs").iterdir():
        assert sha(path.read_bytes()) == path.name  # no blob half written or mixed up
    holder.send_signal(signal.SIGKILL)  # its pin goes with it
    holder.wait(timeout=10)
    for i in range(3):
        cache.put(sha(blob(i, 1000)), blob(i, 1000))
    assert not (root / "blobs" / pinned).exists() and cache.size() <= limit
