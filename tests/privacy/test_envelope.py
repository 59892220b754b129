"""Envelope encryption: round trips, tampering, wrong keys, wrong purposes and wrong jobs."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.errors import BadRequest
from gpuflex.privacy.envelope import (
    decrypt_blob,
    encrypt_blob,
    new_data_key,
    public_bytes,
    seal_for_nodes,
    seal_key,
    unseal_key,
)

KEY = new_data_key()


@settings(max_examples=20, deadline=None)
@given(plaintext=st.binary(max_size=4096), purpose=st.text(max_size=40))
def test_blob_round_trip(plaintext: bytes, purpose: str) -> None:
    blob = encrypt_blob(KEY, plaintext, purpose)
    assert decrypt_blob(KEY, blob, purpose) == plaintext
    assert len(plaintext) < 16 or plaintext not in blob  # a short one may turn up by chance


def test_two_encryptions_differ() -> None:
    assert encrypt_blob(KEY, b"same", "p") != encrypt_blob(KEY, b"same", "p")


@pytest.mark.parametrize(
    ("position", "message"),
    [
        (0, "not a version-1"),  # the version byte
        (5, "another job's data key"),  # the key's fingerprint: indistinguishable from a wrong key
        (12, "tampered"),  # the nonce
        (30, "tampered"),  # the ciphertext
        (-1, "tampered"),  # the tag
    ],
)
def test_tampering_is_detected(position: int, message: str) -> None:
    blob = bytearray(encrypt_blob(KEY, b"a shard's bytes" * 4, "shard:abc"))
    blob[position] ^= 0x01
    with pytest.raises(BadRequest, match=message):
        decrypt_blob(KEY, bytes(blob), "shard:abc")


def test_wrong_key_and_wrong_purpose_are_refused_clearly() -> None:
    blob = encrypt_blob(KEY, b"x", "shard:abc")
    with pytest.raises(BadRequest, match="encrypted under another job's data key"):
        decrypt_blob(new_data_key(), blob, "shard:abc")
    with pytest.raises(BadRequest, match="not the 'shard:def' blob"):
        decrypt_blob(KEY, blob, "shard:def")
    with pytest.raises(BadRequest, match="not a version-1 encrypted blob"):
        decrypt_blob(KEY, blob[:10], "shard:abc")
    with pytest.raises(BadRequest, match="32 bytes, not 16"):
        encrypt_blob(KEY[:16], b"x", "p")


def test_sealing_to_nodes() -> None:
    nodes = {f"node-{i}": X25519PrivateKey.generate() for i in range(3)}
    sealed = seal_for_nodes(KEY, {n: public_bytes(k) for n, k in nodes.items()}, "job-1")
    assert all(unseal_key(sealed[n], k, "job-1") == KEY for n, k in nodes.items())
    assert all(KEY not in s for s in sealed.values())
    with pytest.raises(BadRequest, match="sealed job key was sealed to another key"):
        unseal_key(sealed["node-0"], nodes["node-1"], "job-1")
    with pytest.raises(BadRequest, match="sealed for a job other than job-2"):
        unseal_key(sealed["node-0"], nodes["node-0"], "job-2")


def test_a_tampered_sealed_key_is_refused() -> None:
    node = X25519PrivateKey.generate()
    sealed = bytearray(seal_key(KEY, public_bytes(node), "job-1"))
    sealed[-3] ^= 0x80
    with pytest.raises(BadRequest, match="tampered"):
        unseal_key(bytes(sealed), node, "job-1")
    with pytest.raises(BadRequest, match="raw X25519 public key"):
        seal_key(KEY, b"short", "job-1")
