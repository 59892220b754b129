"""Tensors <-> bytes, always as safetensors: models, checkpoints and pseudo-gradients.

Blobs come from untrusted nodes, so nothing here unpickles (no ``torch.load``): safetensors
holds raw tensors and a string-to-string metadata header, and a malformed blob is a
BadRequest. Tied weights (CharGPT's embedding and output head are one tensor under two
names) are saved as independent copies under both names, so any ``state_dict`` saves as is
and ``load_state_dict`` restores it strictly; the price is one extra copy of each tied tensor.
"""

from __future__ import annotations

import hashlib
import json

import safetensors.torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest


def sha256(data: bytes) -> str:
    """Lower-case hex sha256: a blob's address."""
    return hashlib.sha256(data).hexdigest()


def save_tensors(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """One safetensors blob. Each tensor is copied, so shared or strided tensors save fine."""
    return safetensors.torch.save({k: v.detach().contiguous().clone() for k, v in tensors.items()}, metadata)


def load_tensors(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors blob; BadRequest if it is not one."""
    try:
        tensors = safetensors.torch.load(data)
    except Exception as err:  # safetensors raises its own error type, and others on odd input
        raise BadRequest(f"not a safetensors blob: {err}") from None
    header_len = int.from_bytes(data[:8], "little")  # valid: safetensors has just parsed this header
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    return tensors, metadata


def state_to_bytes(state_dict: dict[str, Tensor]) -> bytes:
    """A model's ``state_dict`` as a safetensors blob."""
    return save_tensors(state_dict)


def bytes_to_state(data: bytes) -> dict[str, Tensor]:
    """The ``state_dict`` saved by ``state_to_bytes``."""
    return load_tensors(data)[0]


def load_into(model: nn.Module, data: bytes) -> None:
    """Load a ``state_to_bytes`` blob into ``model`` in place; BadRequest if it does not fit the model."""
    state = bytes_to_state(data)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # missing or unexpected keys, or a shape mismatch
        raise BadRequest(f"checkpoint does not fit the model: {err}") from None
