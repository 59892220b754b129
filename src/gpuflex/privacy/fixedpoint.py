"""Fixed-point encoding of a pseudo-gradient for secure aggregation: flatten, clip, quantize, decode.

Masks only cancel in a ring, so each float becomes an integer mod ``MODULUS`` (2^32, the uint32
vectors the masks are drawn as). A value clipped to ``[-clip, clip]`` is mapped onto ``levels + 1``
points ``0 .. levels``; with ``levels = (2^32 - 1) // n`` the sum of ``n`` encoded values is at most
``2^32 - 1``, so the sum never wraps and decodes exactly. The bit width per value is therefore
``floor(log2((2^32 - 1) / n))``: 31 bits for 2 clients, 25 for 100, 22 for 1,000; the step is
``2 * clip / levels``, and rounding to the nearest level costs at most half a step per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gpuflex.errors import BadRequest

if TYPE_CHECKING:
    import torch

MODULUS = 2**32


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a delta lies in its flat vector (names sorted, so every client agrees)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def flatten(delta: dict[str, torch.Tensor]) -> tuple[np.ndarray, Layout]:
    """One float64 vector of every tensor of ``delta`` in name order, and the layout to undo it."""
    names = tuple(sorted(delta))
    parts = [delta[k].detach().to("cpu").double().reshape(-1).numpy() for k in names]
    layout = Layout(
        names,
        tuple(tuple(delta[k].shape) for k in names),
        tuple(str(delta[k].dtype).removeprefix("torch.") for k in names),
    )
    vector = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
    return vector, layout


def unflatten(vector: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    """The delta ``flatten`` made ``vector`` from, each tensor in its own shape and dtype."""
    import torch

    if vector.shape != (layout.size,):
        raise BadRequest(f"a vector of {vector.shape} does not fit a layout of {layout.size} values")
    out: dict[str, torch.Tensor] = {}
    start = 0
    for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
        size = math.prod(shape)
        chunk = torch.from_numpy(np.ascontiguousarray(vector[start : start + size]))
        out[name] = chunk.reshape(shape).to(getattr(torch, dtype))
        start += size
    return out


@dataclass(frozen=True)
class FixedPoint:
    """The encoding ``n`` clients share: values clipped to ``[-clip, clip]``, ``levels`` steps across."""

    clip: float
    n: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise BadRequest(f"secure aggregation's clip range must be a positive number, not {self.clip}")
        if self.n < 1 or self.n > MODULUS // 2:
            raise BadRequest(f"secure aggregation over {self.n} clients: out of range")

    @property
    def levels(self) -> int:
        return (MODULUS - 1) // self.n

    @property
    def bits(self) -> int:
        """Resolution per value, in bits (the width of ``levels``)."""
        return (self.levels + 1).bit_length() - 1

    @property
    def step(self) -> float:
        return 2 * self.clip / self.levels

    def encode(self, values: np.ndarray) -> np.ndarray:
        """Each value clipped and rounded to its nearest level: uint32 in ``0 .. levels``."""
        values = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise BadRequest("a vector with NaN or infinite values cannot be encoded")
        clipped = np.clip(values, -self.clip, self.clip)
        return np.rint((clipped + self.clip) / self.step).astype(np.uint32)

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of ``count`` encoded vectors whose ring sum (mod 2^32) is ``total``."""
        if not 1 <= count <= self.n:
            raise BadRequest(f"a sum of {count} contributions, but the encoding is for at most {self.n}")
        return total.astype(np.float64) * self.step - count * self.clip
