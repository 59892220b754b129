"""Ed25519 request signatures: every node request signs method, path, body hash, time and nonce.

The coordinator refuses a bad signature, a timestamp outside the allowed skew and a nonce it
has seen (replay). The message is canonical text so any client can reproduce it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gpuflex.errors import Unauthorized

HEADER_NODE = "X-GPUFlex-Node"
HEADER_TIMESTAMP = "X-GPUFlex-Timestamp"
HEADER_NONCE = "X-GPUFlex-Nonce"
HEADER_SIGNATURE = "X-GPUFlex-Signature"


def canonical_message(method: str, path: str, body: bytes, timestamp: str, nonce: str) -> bytes:
    return _message(method, path, hashlib.sha256(body).hexdigest(), timestamp, nonce)


def _message(method: str, path: str, body_sha256: str, timestamp: str, nonce: str) -> bytes:
    """The signed text names the body by its hash: a verifier that knows the hash (a blob upload's key,
    which the body must hash to) checks the signature before the body arrives."""
    return "\n".join([method.upper(), path, body_sha256, timestamp, nonce]).encode()


def node_id_for(public_key_hex: str) -> str:
    """A node's id is derived from its key, so nobody can claim another node's id."""
    return "n-" + hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()[:16]


@dataclass(frozen=True)
class NodeKey:
    """A node's Ed25519 key pair."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_hex(cls, private_key_hex: str) -> NodeKey:
        """The key whose raw 32-byte Ed25519 private key is ``private_key_hex``; ValueError if it is not."""
        return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_key_hex)))

    @classmethod
    def load_or_create(cls, path: Path) -> NodeKey:
        """Load the key at ``path``, making it (mode 0600) on first start."""
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise Unauthorized(f"{path} is not an Ed25519 private key")
            return cls(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        node_key = cls.generate()
        pem = node_key.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return node_key

    @property
    def public_key_hex(self) -> str:
        raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return raw.hex()

    @property
    def node_id(self) -> str:
        return node_id_for(self.public_key_hex)

    def sign_request(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """Headers that authenticate one request."""
        timestamp = f"{time.time():.3f}"
        nonce = secrets.token_hex(16)
        signature = self.private_key.sign(canonical_message(method, path, body, timestamp, nonce))
        return {
            HEADER_NODE: self.node_id,
            HEADER_TIMESTAMP: timestamp,
            HEADER_NONCE: nonce,
            HEADER_SIGNATURE: signature.hex(),
        }


def sealing_key_statement(sealing_key_hex: str) -> bytes:
    """What a node signs to vouch for its X25519 sealing key (``privacy.encrypt``)."""
    return b"gpuflex/sealing-key/v1/" + bytes.fromhex(sealing_key_hex)


def sign_sealing_key(node_key: NodeKey, sealing_key_hex: str) -> str:
    return node_key.private_key.sign(sealing_key_statement(sealing_key_hex)).hex()


def check_sealing_key(node_id: str, public_key_hex: str, sealing_key_hex: str, signature_hex: str) -> None:
    """Refuse a sealing key that node ``node_id`` did not sign: its id is the hash of ``public_key_hex``,
    so whoever relays the three (the coordinator) can swap none of them unnoticed."""
    if node_id_for(public_key_hex) != node_id:
        raise Unauthorized(f"node {node_id}'s public key does not hash to its id: refusing to seal to it")
    statement = sealing_key_statement(sealing_key_hex)
    try:
        _public_key(public_key_hex).verify(bytes.fromhex(signature_hex), statement)
    except (InvalidSignature, ValueError):
        raise Unauthorized(f"node {node_id} did not sign this sealing key: refusing to seal to it") from None


@functools.lru_cache(maxsize=1 << 16)
def _public_key(public_key_hex: str) -> Ed25519PublicKey:
    """Parsed once per key: a coordinator checks the same nodes' signatures over and over."""
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))


@dataclass(frozen=True)
class SignedRequest:
    """A request whose signature headers are well formed and fresh; ``verify`` checks the signature.

    Apart because checking an Ed25519 signature is the costly part (about 0.1 ms here, with the GIL
    released): a coordinator can do it off its event loop."""

    public_key_hex: str
    signature: bytes
    message: bytes
    nonce: str

    def verify(self) -> str:
        """Check the signature; return the nonce (the caller checks replay)."""
        try:
            _public_key(self.public_key_hex).verify(self.signature, self.message)
        except (InvalidSignature, ValueError):
            raise Unauthorized("bad request signature") from None
        return self.nonce


def signed_request(
    public_key_hex: str,
    method: str,
    path: str,
    body_sha256: str,
    headers: Mapping[str, str],
    *,
    now: float,
    max_skew_s: float,
) -> SignedRequest:
    """A request's signature headers, checked for form and freshness but not yet verified.

    ``headers`` may be case-insensitive (as Starlette's are); the names above are looked up as given.
    """
    try:
        timestamp = headers[HEADER_TIMESTAMP]
        nonce = headers[HEADER_NONCE]
        signature = bytes.fromhex(headers[HEADER_SIGNATURE])
        sent_at = float(timestamp)
    except (KeyError, ValueError):
        raise Unauthorized("missing or malformed signature headers") from None
    if not 8 <= len(nonce) <= 64:
        raise Unauthorized("malformed nonce")
    if abs(now - sent_at) > max_skew_s:
        raise Unauthorized(f"request timestamp is more than {max_skew_s:.0f}s from the coordinator's clock")
    message = _message(method, path, body_sha256, timestamp, nonce)
    return SignedRequest(public_key_hex, signature, message, nonce)
