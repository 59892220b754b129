"""Envelope encryption for ``privacy.encrypt``: blobs under a per-job data key, the key sealed to nodes.

The consumer's machine makes one random 256-bit data key per job and encrypts every blob with AES-GCM
before upload; the associated data names the blob's purpose (``"shard:<sha256>"``, ``"model:..."``), so
a ciphertext moved to another slot fails to open. The data key is sealed to the X25519 public key of
each node holding a live lease with HPKE (RFC 9180 base mode: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
AES-256-GCM, from ``cryptography``), the job id in its info. The blob store and the coordinator only ever
hold ciphertexts and sealed keys.

``seal``/``unseal`` are that box for any small secret: secure aggregation's share bundles travel in it.
Both formats start with a version byte and an 8-byte fingerprint (of the data key, of the recipient's
public key), so a wrong key is told apart from tampering in the error, at no cost to secrecy.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gpuflex.errors import BadRequest

VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
FINGERPRINT_BYTES = 8
_HEADER = 1 + FINGERPRINT_BYTES
BLOB_OVERHEAD = _HEADER + NONCE_BYTES + 16  # what ``encrypt_blob`` adds to a plaintext: header, nonce, tag
_SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
# the purpose of every blob of an encrypted job (dataset, recipe, updates, checkpoints): the data key is
# that job's alone, and a blob is fetched by the hash of its ciphertext, so no finer slot is needed
JOB_BLOB = "job blob"


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=8 * KEY_BYTES)


def _fingerprint(label: bytes, material: bytes) -> bytes:
    return hashlib.sha256(b"gpuflex/envelope/" + label + material).digest()[:FINGERPRINT_BYTES]


def _split(box: bytes, what: str, minimum: int) -> tuple[bytes, bytes]:
    if len(box) < _HEADER + minimum or box[0] != VERSION:
        raise BadRequest(f"not a version-{VERSION} {what} ({len(box)} bytes)")
    return box[1:_HEADER], box[_HEADER:]


def encrypt_blob(data_key: bytes, plaintext: bytes, purpose: str) -> bytes:
    """``plaintext`` under ``data_key``: version, key fingerprint, nonce, ciphertext and tag."""
    if len(data_key) != KEY_BYTES:
        raise BadRequest(f"a data key is {KEY_BYTES} bytes, not {len(data_key)}")
    header = bytes([VERSION]) + _fingerprint(b"data-key", data_key)
    nonce = os.urandom(NONCE_BYTES)  # random 96-bit nonces: safe for far more blobs than a job has
    return header + nonce + AESGCM(data_key).encrypt(nonce, plaintext, header + purpose.encode())


def decrypt_blob(data_key: bytes, blob: bytes, purpose: str) -> bytes:
    fingerprint, body = _split(blob, "encrypted blob", NONCE_BYTES + 16)
    if fingerprint != _fingerprint(b"data-key", data_key):
        raise BadRequest("this blob was encrypted under another job's data key")
    nonce, ciphertext = body[:NONCE_BYTES], body[NONCE_BYTES:]
    try:
        return AESGCM(data_key).decrypt(nonce, ciphertext, blob[:_HEADER] + purpose.encode())
    except InvalidTag:
        raise BadRequest(f"encrypted blob fails its check: tampered, or not the {purpose!r} blob") from None


def keyed_digest(data_key: bytes, data: bytes) -> str:
    """HMAC-SHA256 of ``data`` under the job's data key: a check of plaintext that only the key's holders
    can test a guess against (an encrypted model directory's manifest, which the consumer compares)."""
    return hmac.new(data_key, b"gpuflex/envelope/digest" + data, hashlib.sha256).hexdigest()


def public_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def seal(plaintext: bytes, public_key: bytes, info: bytes) -> bytes:
    """``plaintext`` sealed to a raw X25519 public key; ``info`` binds it to its use (HPKE base mode)."""
    try:
        recipient = X25519PublicKey.from_public_bytes(public_key)
    except ValueError as e:
        raise BadRequest(f"a sealing key must be a raw X25519 public key: {e}") from None
    header = bytes([VERSION]) + _fingerprint(b"recipient", public_key)
    return header + _SUITE.encrypt(plaintext, recipient, info=info + header)


def unseal(sealed: bytes, private_key: X25519PrivateKey, info: bytes, what: str, use: str) -> bytes:
    """What ``seal`` sealed to ``private_key``'s public key for ``info``; errors name ``what`` and ``use``."""
    fingerprint, body = _split(sealed, what, 32 + 16)
    if fingerprint != _fingerprint(b"recipient", public_bytes(private_key)):
        raise BadRequest(f"this {what} was sealed to another key")
    try:
        return _SUITE.decrypt(body, private_key, info=info + sealed[:_HEADER])
    except InvalidTag:
        raise BadRequest(f"{what} fails its check: tampered, or sealed {use}") from None


def _info(job_id: str) -> bytes:
    return b"gpuflex/job-key/" + job_id.encode()


def seal_key(data_key: bytes, node_public_key: bytes, job_id: str) -> bytes:
    """``data_key`` sealed to one node's X25519 public key, for ``job_id`` only."""
    return seal(data_key, node_public_key, _info(job_id))


def seal_for_nodes(data_key: bytes, node_keys: dict[str, bytes], job_id: str) -> dict[str, bytes]:
    """The data key sealed to every node with a live lease on the job (node id -> sealed key)."""
    return {node: seal_key(data_key, key, job_id) for node, key in node_keys.items()}


def unseal_key(sealed: bytes, node_private_key: X25519PrivateKey, job_id: str) -> bytes:
    return unseal(sealed, node_private_key, _info(job_id), "sealed job key", f"for a job other than {job_id}")


_CONSUMER = b"gpuflex/consumer-key"  # sealed before the job has an id: bound to its use, not its job


def seal_for_consumer(data_key: bytes, consumer_public_key: bytes) -> bytes:
    """``data_key`` sealed to the consumer's own X25519 key: the copy the job is submitted with, from which
    the consumer's CLI seals it to nodes and opens the job's checkpoints."""
    return seal(data_key, consumer_public_key, _CONSUMER)


def unseal_for_consumer(sealed: bytes, consumer_private_key: X25519PrivateKey) -> bytes:
    return unseal(sealed, consumer_private_key, _CONSUMER, "job's data key", "for another use")
