"""X25519 sealing keys (``privacy.encrypt``): a node's, which jobs' data keys are sealed to while it holds
a lease, and a consumer's, which its own jobs' data keys (and so their checkpoints) open with.

Kept as 32 raw bytes in a file of mode 0600 beside the owner's other keys, made on first use.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from gpuflex.errors import BadRequest


def load(path: Path) -> X25519PrivateKey:
    raw = path.read_bytes()
    if len(raw) != 32:
        raise BadRequest(f"{path} is not an X25519 private key (32 raw bytes): move it away")
    return X25519PrivateKey.from_private_bytes(raw)


def load_or_create(path: Path) -> X25519PrivateKey:
    """The key at ``path``, made (mode 0600) if there is none."""
    if path.exists():
        return load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = X25519PrivateKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))
    return key
