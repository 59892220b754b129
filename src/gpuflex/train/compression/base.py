"""The two interfaces of compression, ``ValueCodec`` and ``Compressor``, and the wire format they share.

- A ``ValueCodec`` turns a flat fp32 vector into a few named tensors, its *parts* (``codes``, ``scale``
  ...), and back; consecutive blocks of ``block`` values may share a scale. The dense codecs
  (``floats``, ``quant``) are value codecs; top-k encodes the values it keeps with one.
- A ``Compressor`` turns named tensors into one safetensors blob and back. ``Dense`` applies a value
  codec to every tensor; ``topk.TopK`` sparsifies each tensor first.

The wire format: part ``p`` of tensor ``t`` is the safetensors tensor ``t:p``; the metadata holds
``compression`` (the method), ``params`` (canonical JSON of the settings both ends must share) and
``shapes`` (JSON, tensor name -> shape). The bytes on the wire are ``len(blob)``, header included.

Blobs come from untrusted nodes, so a decoder believes nothing it has not checked: the blob must be
safetensors, of its own method and params; the shapes must be lists of non-negative ints; every part
must have exactly the dtype and length the shapes imply, and there must be no other tensors; whatever
a codec interprets (code ranges, indices) is range-checked; and decoded values must be finite. Any
failure is a BadRequest naming what is wrong. Decoding is deterministic: elementwise IEEE ops and
scatters to distinct indices, so every replica decodes a blob to the same bits.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import safetensors.torch
import torch
from torch import Tensor

from gpuflex.errors import BadRequest
from gpuflex.train.checkpoint import load_tensors

Parts = dict[str, Tensor]
MAX_MAGNITUDE = 1e38  # the largest |value| compress takes: scales and levels derived from it stay finite


def take(parts: Parts, key: str, dtype: torch.dtype, numel: int) -> Tensor:
    """Remove and return part ``key``, a BadRequest unless it has exactly ``dtype`` and ``numel``."""
    if key not in parts:
        raise BadRequest(f"part {key!r} is missing")
    part = parts.pop(key)
    if part.dtype != dtype or part.numel() != numel:
        raise BadRequest(f"part {key!r} is {part.numel()} × {part.dtype}, expected {numel} × {dtype}")
    return part.reshape(-1)


def blocks_of(flat: Tensor, block: int) -> Tensor:
    """``flat`` zero-padded to a whole number of blocks, as (blocks, block); a view if none is needed."""
    pad = -flat.numel() % block
    return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, block)


class ValueCodec(ABC):
    """A flat fp32 vector <-> its parts. ``block``: values that may share a scale (ignored by casts)."""

    name: ClassVar[str]
    scaled: ClassVar[bool]  # whether ``block`` matters, so both ends must agree on it

    @abstractmethod
    def encode(self, flat: Tensor, block: int) -> Parts: ...

    @abstractmethod
    def decode(self, parts: Parts, numel: int, block: int) -> Tensor:
        """The ``numel`` fp32 values, taking its parts out of ``parts``; BadRequest if they are malformed."""


class Compressor(ABC):
    """Named fp32 tensors <-> one safetensors blob."""

    name: str  # the method, as in CompressionSpec: "int8", "topk", ...

    @property
    @abstractmethod
    def params(self) -> dict[str, object]:
        """Settings the sender and the receiver must share, besides the method."""

    @abstractmethod
    def encode(self, flat: Tensor) -> Parts:
        """One tensor's parts."""

    @abstractmethod
    def decode(self, parts: Parts, numel: int) -> Tensor:
        """One tensor, flat, taking its parts out of ``parts``; BadRequest if malformed."""

    def compress(self, tensors: Mapping[str, Tensor]) -> bytes:
        """The blob for ``tensors``, as fp32 on the CPU. ValueError if a value is not finite or beyond
        ``MAX_MAGNITUDE``: such a delta means training has diverged, and no blob of it would be accepted."""
        return self._save(self._encode_all(tensors), tensors)

    def compress_with_echo(self, tensors: Mapping[str, Tensor]) -> tuple[bytes, dict[str, Tensor]]:
        """The blob and, without parsing it, exactly what ``decompress(blob)`` returns (bit for bit).

        For the lossless codec the echoed tensors may share memory with ``tensors``.
        """
        encoded = self._encode_all(tensors)
        return self._save(encoded, tensors), self._echo(encoded, tensors)

    def echo(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """What ``decompress(compress(tensors))`` returns (bit for bit), without building the blob: an
        auditor re-deriving a worker's delta needs no bytes."""
        return self._echo(self._encode_all(tensors), tensors)

    def _echo(self, encoded: dict[str, Parts], tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {
            name: self.decode(dict(parts), math.prod(tensors[name].shape)).view(tensors[name].shape)
            for name, parts in encoded.items()
        }

    def decompress(self, data: bytes, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Tensor]:
        """The tensors, as fp32, in the order they were compressed. BadRequest if ``data`` is not a
        well-formed blob of this compressor, or (given ``shapes``) does not hold exactly these shapes,
        which a receiver should pass so a hostile header cannot make it allocate more than it expects."""
        tensors, metadata = load_tensors(data)
        self._check_method(metadata)
        declared = _read_shapes(metadata)
        if shapes is not None and declared != {k: list(v) for k, v in shapes.items()}:
            raise BadRequest(f"blob holds shapes {declared}, expected {dict(shapes)}")
        grouped = _group(tensors, declared)
        out = {}
        for name, shape in declared.items():
            try:
                out[name] = self._decode_one(grouped[name], shape)
            except BadRequest as err:
                raise BadRequest(f"malformed {self.name} blob: tensor {name!r}: {err.message}") from None
        return out

    def _decode_one(self, parts: Parts, shape: list[int]) -> Tensor:
        values = self.decode(parts, math.prod(shape))
        if parts:
            raise BadRequest(f"unexpected parts {sorted(parts)}")
        if not torch.isfinite(values).all():
            raise BadRequest("decodes to non-finite values")
        return values.view(shape)

    def _encode_all(self, tensors: Mapping[str, Tensor]) -> dict[str, Parts]:
        return {name: self.encode(_flat(name, t)) for name, t in tensors.items()}

    def _save(self, encoded: dict[str, Parts], tensors: Mapping[str, Tensor]) -> bytes:
        flat = {
            f"{name}:{key}": part.contiguous()
            for name, parts in encoded.items()
            for key, part in parts.items()
        }
        shapes = {name: list(t.shape) for name, t in tensors.items()}
        metadata = {"compression": self.name, "params": self._params_json(), "shapes": json.dumps(shapes)}
        return safetensors.torch.save(flat, metadata)

    def _params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)

    def _check_method(self, metadata: dict[str, str]) -> None:
        method = metadata.get("compression")
        if method != self.name:
            raise BadRequest(f"blob was compressed with {method!r}, expected {self.name!r}")
        ours, theirs = self._params_json(), metadata.get("params")
        if theirs != ours:
            raise BadRequest(f"blob was compressed with {self.name} {theirs}, expected {self.name} {ours}")


def _flat(name: str, tensor: Tensor) -> Tensor:
    """``tensor`` as a flat fp32 CPU vector; ValueError if it holds values no codec may send."""
    flat = tensor.detach().to("cpu", torch.float32).reshape(-1)
    if flat.numel():
        low, high = torch.aminmax(flat)
        if not (low >= -MAX_MAGNITUDE and high <= MAX_MAGNITUDE):  # NaN fails both comparisons
            raise ValueError(f"tensor {name!r} has values that are not finite or beyond ±{MAX_MAGNITUDE:g}")
    return flat


def _read_shapes(metadata: dict[str, str]) -> dict[str, list[int]]:
    try:
        shapes = json.loads(metadata["shapes"])
    except (KeyError, ValueError) as err:  # ValueError: bad JSON, or an integer too long to parse
        raise BadRequest(f"blob has no readable shapes: {err!r}") from None
    if not isinstance(shapes, dict) or not all(
        isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in shapes.values()
    ):
        raise BadRequest(f"blob's shapes are not lists of non-negative integers: {str(shapes)[:200]}")
    return shapes


def _group(tensors: dict[str, Tensor], shapes: dict[str, list[int]]) -> dict[str, Parts]:
    """The blob's tensors by the name before the last ':'; BadRequest for any not in ``shapes``."""
    grouped: dict[str, Parts] = {name: {} for name in shapes}
    for key, tensor in tensors.items():
        name, _, part = key.rpartition(":")
        if name not in grouped:
            raise BadRequest(f"blob holds tensor {key!r}, which is not in its shapes")
        grouped[name][part] = tensor
    return grouped


class Dense(Compressor):
    """A value codec applied to every tensor, as one flat vector."""

    def __init__(self, codec: ValueCodec, block_size: int = 256):
        assert block_size >= 1, f"block_size {block_size}"
        self.codec = codec
        self.block_size = block_size
        self.name = codec.name

    @property
    def params(self) -> dict[str, object]:
        return {"block_size": self.block_size} if self.codec.scaled else {}

    def encode(self, flat: Tensor) -> Parts:
        return self.codec.encode(flat, self.block_size)

    def decode(self, parts: Parts, numel: int) -> Tensor:
        return self.codec.decode(parts, numel, self.block_size)
