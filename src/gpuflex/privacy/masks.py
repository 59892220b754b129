"""The primitives of secure aggregation: key agreement, seeds, mask expansion and secret sharing.

- X25519 key pairs (``cryptography``); a pair's shared secret goes through HKDF-SHA256 with the job,
  the round and both client indices in its info, so a seed is never reused across rounds or pairs.
- Masks are a ChaCha20 keystream (``cryptography``) read as little-endian uint32: a 256-bit key
  expands to any length, and nothing but the key can predict it.
- Secrets are Shamir-shared over GF(2^128) with pycryptodome: a 16-byte self-mask seed is one
  secret; a 32-byte X25519 private key is two halves shared at the same points.
"""

from __future__ import annotations

import struct

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from gpuflex.errors import BadRequest

SEED_BYTES = 16
Share = tuple[int, bytes]  # (x, y): the point a holder keeps; x = holder index + 1


def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _context(job_id: str, round_: int, label: bytes, *indices: int) -> bytes:
    job = job_id.encode()
    return (
        b"gpuflex/secagg/"
        + label
        + struct.pack(f">I{len(job)}sQ", len(job), job, round_)
        + b"".join(struct.pack(">I", i) for i in indices)
    )


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def pairwise_key(
    private: X25519PrivateKey, peer_public: bytes, job_id: str, round_: int, u: int, v: int
) -> bytes:
    """The 32-byte mask key clients ``u`` and ``v`` both derive (order-free: the lower index first)."""
    try:
        peer = X25519PublicKey.from_public_bytes(peer_public)
    except ValueError as e:
        raise BadRequest(f"client {v}'s public key is not an X25519 key: {e}") from None
    shared = private.exchange(peer)
    return _hkdf(shared, _context(job_id, round_, b"pair", min(u, v), max(u, v)))


def self_mask_key(seed: bytes, job_id: str, round_: int, u: int) -> bytes:
    return _hkdf(seed, _context(job_id, round_, b"self", u))


def expand(key: bytes, length: int) -> np.ndarray:
    """``length`` uint32 values of ChaCha20's keystream under ``key`` (a fresh key per use: zero nonce)."""
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32, copy=False)


def split(secret: bytes, threshold: int, n: int) -> list[list[Share]]:
    """Shamir shares of ``secret`` (16 bytes or a multiple): ``shares[holder]`` is one list per 16 bytes."""
    halves = [secret[i : i + SEED_BYTES] for i in range(0, len(secret), SEED_BYTES)]
    per_half = [Shamir.split(threshold, n, half) for half in halves]
    return [[per_half[h][holder] for h in range(len(halves))] for holder in range(n)]


def combine(shares: list[list[Share]], threshold: int) -> bytes:
    """The secret ``threshold`` holders' shares (as ``split`` gave them) reconstruct."""
    if len(shares) < threshold:
        raise BadRequest(f"{len(shares)} shares cannot rebuild a secret shared with threshold {threshold}")
    chosen = shares[:threshold]
    return b"".join(Shamir.combine([held[h] for held in chosen]) for h in range(len(chosen[0])))
