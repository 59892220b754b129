"""Pseudo-gradient codecs, and the error feedback that makes lossy ones unbiased over rounds.

A ``Compressor`` turns named fp32 tensors into one safetensors blob and back; the bytes on
the wire are ``len(blob)``. Every blob names its codec in its metadata, so decoding with the
wrong one is a BadRequest rather than garbage. Codecs, by ``get_compressor`` name:

- ``none``  fp32, exact                               4 bytes / element
- ``fp16``  half precision, relative error <= 2^-11   2 bytes / element
- ``int8``  blockwise absmax: each block of 256 elements keeps int8 values and one fp32
            scale (absmax / 127); error <= scale / 2  ~1.02 bytes / element

``ErrorFeedback`` keeps, on the worker, what compression lost last round and adds it to the
next pseudo-gradient, so the sum of what is sent tracks the sum of the true pseudo-gradients.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, get_args

import torch
from torch import Tensor

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import Compression
from gpuflex.train.checkpoint import load_tensors, save_tensors

FP16_MAX = 65504.0  # larger magnitudes would become inf; they are clamped instead


class Compressor(ABC):
    """Named fp32 tensors <-> one safetensors blob."""

    name: ClassVar[str]

    @abstractmethod
    def compress(self, tensors: dict[str, Tensor]) -> bytes: ...

    @abstractmethod
    def decompress(self, data: bytes) -> dict[str, Tensor]:
        """The tensors, as fp32; BadRequest if ``data`` is not this codec's blob."""

    def _save(self, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
        return save_tensors(tensors, {"compression": self.name, **(metadata or {})})

    def _load(self, data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
        tensors, metadata = load_tensors(data)
        codec = metadata.get("compression")
        if codec != self.name:
            raise BadRequest(f"blob was compressed with {codec!r}, expected {self.name!r}")
        return tensors, metadata


class NoCompression(Compressor):
    name = "none"

    def compress(self, tensors: dict[str, Tensor]) -> bytes:
        return self._save({k: v.float() for k, v in tensors.items()})

    def decompress(self, data: bytes) -> dict[str, Tensor]:
        return {k: v.float() for k, v in self._load(data)[0].items()}


class Fp16(Compressor):
    name = "fp16"

    def compress(self, tensors: dict[str, Tensor]) -> bytes:
        return self._save({k: v.float().clamp(-FP16_MAX, FP16_MAX).half() for k, v in tensors.items()})

    def decompress(self, data: bytes) -> dict[str, Tensor]:
        return {k: v.float() for k, v in self._load(data)[0].items()}


@dataclass(frozen=True)
class Int8Settings:
    block_size: int = 256  # elements sharing one scale: 4 bytes of scale per 256 bytes of values


class Int8(Compressor):
    """Blockwise absmax int8. Per tensor ``t``: ``t:q`` (int8, flat) and ``t:scale`` (fp32, one per block);
    the original shapes are in the metadata under ``shapes`` (JSON)."""

    name = "int8"

    def __init__(self, settings: Int8Settings = Int8Settings()):
        self.settings = settings

    def compress(self, tensors: dict[str, Tensor]) -> bytes:
        out: dict[str, Tensor] = {}
        for name, t in tensors.items():
            out[f"{name}:q"], out[f"{name}:scale"] = self._quantize(t.detach().float().flatten())
        shapes = {name: list(t.shape) for name, t in tensors.items()}
        return self._save(out, {"shapes": json.dumps(shapes), "block_size": str(self.settings.block_size)})

    def decompress(self, data: bytes) -> dict[str, Tensor]:
        tensors, metadata = self._load(data)
        try:
            shapes = json.loads(metadata["shapes"])
            block = int(metadata["block_size"])
            if block < 1:
                raise ValueError(f"block_size {block}")
            return {name: self._dequantize(tensors, name, shape, block) for name, shape in shapes.items()}
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as err:
            raise BadRequest(f"malformed int8 blob: {err!r}") from None

    def _quantize(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        blocks = _pad_to_blocks(flat, self.settings.block_size)
        scale = blocks.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
        q = (blocks / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
        return q.flatten()[: flat.numel()], scale

    @staticmethod
    def _dequantize(tensors: dict[str, Tensor], name: str, shape: list[int], block: int) -> Tensor:
        q, scale = tensors[f"{name}:q"], tensors[f"{name}:scale"]
        numel = math.prod(shape)
        if q.dtype != torch.int8 or q.numel() != numel or scale.numel() != -(-numel // block):
            raise BadRequest(f"malformed int8 blob: tensor {name!r} does not match its shape {shape}")
        values = _pad_to_blocks(q.float(), block) * scale.float()[:, None]
        return values.flatten()[:numel].reshape(shape)


def _pad_to_blocks(flat: Tensor, block: int) -> Tensor:
    """``flat`` zero-padded to a whole number of blocks, as (blocks, block)."""
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)


COMPRESSORS: dict[str, type[Compressor]] = {c.name: c for c in (NoCompression, Fp16, Int8)}
assert set(COMPRESSORS) == set(get_args(Compression)), "every Compression in the spec needs a codec"


def get_compressor(name: str) -> Compressor:
    """The codec called ``name`` ("none" | "fp16" | "int8"); BadRequest for any other."""
    if name not in COMPRESSORS:
        raise BadRequest(f"unknown compression {name!r}; known: {', '.join(COMPRESSORS)}")
    return COMPRESSORS[name]()


class ErrorFeedback:
    """Compression with memory: what was lost compressing one pseudo-gradient is added to the next.

    The residual is ``Δ + residual - decompress(compress(Δ + residual))``. If the blob is never
    applied (the round closed before it arrived), ``revert`` forgets that compression.
    """

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.residual: dict[str, Tensor] = {}
        self._previous: dict[str, Tensor] = {}

    def compress(self, delta: dict[str, Tensor]) -> bytes:
        corrected = {k: v.detach().float() + self.residual.get(k, 0.0) for k, v in delta.items()}
        blob = self.compressor.compress(corrected)
        sent = self.compressor.decompress(blob)
        self._previous, self.residual = self.residual, {k: corrected[k] - sent[k] for k in corrected}
        return blob

    def revert(self) -> None:
        """Undo the last ``compress``: its blob was not used, so its residual must not be either."""
        self.residual = self._previous
