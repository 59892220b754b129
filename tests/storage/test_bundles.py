"""A directory as blobs: parts under the blob limit, joined and checked on the way back."""

import hashlib
import threading

import pytest

from gpuflex.errors import BadRequest
from gpuflex.storage.bundles import Bundle, bundle_directory, file_parts, materialize, model_problem
from gpuflex.storage.fetching import FETCH_WORKERS


@pytest.fixture
def directory(tmp_path):
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_bytes(b'{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 40)  # 10,240 bytes: 3 parts of 4 KiB
    (root / "empty.txt").write_bytes(b"")
    (root / ".hidden").write_bytes(b"left out")
    return root


def test_large_files_go_in_parts_under_the_limit_and_come_back_whole(directory, tmp_path):
    bundle, parts = bundle_directory(directory, part_bytes=4096)
    assert [f.name for f in bundle.files] == ["config.json", "empty.txt", "model.safetensors"]
    weights = bundle.file("model.safetensors")
    assert [p.size for p in weights.parts] == [4096, 4096, 2048]
    assert weights.sha256 == hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    assert bundle.file("config.json").parts[0].sha256 == bundle.file("config.json").sha256  # a file that fits
    store = {p.sha256: p.read() for p in parts}
    assert all(len(blob) <= 4096 for blob in store.values())
    again = Bundle.from_bytes(bundle.to_bytes())
    out = materialize(again, store.__getitem__, tmp_path / "out")
    for f in bundle.files:
        assert (out / f.name).read_bytes() == (directory / f.name).read_bytes()
    assert not (out / ".hidden").exists()


def test_a_corrupt_part_or_a_name_outside_the_directory_is_refused(directory, tmp_path):
    bundle, parts = bundle_directory(directory, part_bytes=4096)
    store = {p.sha256: p.read() for p in parts}
    first = bundle.file("model.safetensors").parts[0].sha256
    store[first] = b"x" * 4096
    with pytest.raises(BadRequest, match=r"model\.safetensors arrived corrupted"):
        materialize(bundle, store.__getitem__, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    hostile = bundle.to_bytes().replace(b'"config.json"', b'"../evil.json"')
    with pytest.raises(BadRequest, match="not a model manifest"):
        Bundle.from_bytes(hostile)


def test_a_model_directory_needs_a_config_and_safetensors_weights():
    assert model_problem(["config.json", "model.safetensors"]) is None
    assert "has no config.json" in model_problem(["model.safetensors"])
    assert model_problem(["config.json", "pytorch_model.bin"]) == (
        "has no weights (*.safetensors) (only safetensors weights travel; a .bin is a pickle)"
    )


def test_a_bundle_stored_as_other_keys_fetches_by_them_and_checks_what_it_opens(directory, tmp_path):
    """An encrypted job's bundle: each part fetched by its stored (ciphertext) key, opened by ``fetch``,
    and checked against its plaintext hash; a plain bundle's bytes do not change."""
    bundle, parts = bundle_directory(directory, part_bytes=4096)
    assert b'"blob"' not in bundle.to_bytes()  # a plain manifest's hash is what it always was
    stored = {hashlib.sha256(b"sealed" + p.read()).hexdigest(): p.read() for p in parts}
    sealed = bundle.stored_as({hashlib.sha256(d).hexdigest(): k for k, d in stored.items()})
    assert set(sealed.digests()) == set(stored) and Bundle.from_bytes(sealed.to_bytes()) == sealed
    out = materialize(sealed, stored.__getitem__, tmp_path / "out")
    assert (out / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()
    key = sealed.file("config.json").parts[0].key
    stored[key] = b"{}"  # opened to other bytes than the manifest's plaintext hash: refused
    with pytest.raises(BadRequest, match=r"config\.json arrived corrupted"):
        materialize(sealed, stored.__getitem__, tmp_path / "again")


def test_a_files_parts_are_fetched_at_once_and_joined_in_order(directory, tmp_path):
    bundle, parts = bundle_directory(directory, part_bytes=1280)  # the weights: 8 parts, two barriers full
    store = {p.sha256: p.read() for p in parts}
    together = threading.Barrier(FETCH_WORKERS, timeout=30)  # broken unless that many fetches run at once

    def fetch(key: str) -> bytes:
        together.wait()
        return store[key]

    weights = bundle.file("model.safetensors")
    assert len(weights.parts) == 2 * FETCH_WORKERS
    joined = b"".join(file_parts(weights, fetch))
    assert joined == (directory / "model.safetensors").read_bytes()
