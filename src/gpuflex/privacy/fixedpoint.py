"""Fixed-point encodings of a pseudo-gradient for secure aggregation: flatten, clip, quantize, decode.

Masks only cancel in a ring, so each float becomes an integer mod 2^``ring_bits``. Two encodings:

- ``FixedPoint``, the wide ring (2^32, the uint32 words the masks are drawn as), for dense float
  updates (``compression: none``, fp16, bf16, top-k);
- ``SharedGrid``, a narrow ring for a quantized compressor's codes (int8, int4, int2): below.

``FixedPoint``: A value clipped to ``[-clip, clip]`` is mapped onto ``levels + 1``
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
WIDE_BITS = 32


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a delta lies in its flat vector (names sorted, so every client agrees)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def size(self) -> int:
        return sum(self.sizes)


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

    ring_bits = WIDE_BITS

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


@dataclass(frozen=True, eq=False)
class SharedGrid:
    """A narrow ring for quantized updates: one quantization every owner agreed before masking.

    Owner ``i`` masks its share of the average, ``w_i / W · Δ_i`` (plus, under DP, its noise share); for
    tensor ``j`` the job agrees a range ``R_j`` that bounds one owner's ``|Δ_i|`` (posted by the
    aggregator) and, under DP, a span ``e`` for a noise share. Owner ``i``'s values then lie within
    ``a_ij = w_i / W · R_j + e``; the tensor's step is ``s_j = Σ_i a_ij / levels`` (the SUM spans
    ``levels`` steps each way, the resolution of one compressed update: 127 under int8), and owner ``i``
    rounds to ``q = round(x / s_j)`` clamped to ``±ceil(a_ij / s_j)``. Every owner's codes are in the same
    units, so they add exactly, and ``Σ_i |q_i| ≤ levels + owners``: a ring of ``ring_bits`` =
    ``bit_length(2 · (levels + owners))`` bits (9 for int8 and up to 128 owners) holds the signed sum
    without wrapping. What the rounding and clamping drop, the owner keeps in its error feedback.
    """

    step: np.ndarray  # per value: the tensor's step s_j
    ring_bits: int
    limit: np.ndarray | None = None  # per value: this owner's largest |code|; None where it only decodes

    @staticmethod
    def bits_for(levels: int, owners: int) -> int:
        return (2 * (levels + owners)).bit_length()

    @classmethod
    def agree(
        cls,
        sizes: list[int],
        ranges: list[float],
        shares: dict[str, float],
        owner: str | None,
        levels: int,
        noise_span: float = 0.0,
    ) -> SharedGrid:
        """The grid for tensors of ``sizes`` values and ``ranges``, owners' ``shares`` (``w_i / W``);
        ``owner``'s clamp limits (None: the aggregator's, which only decodes). Every party computes the
        same steps from the same public facts."""
        if len(ranges) != len(sizes):
            raise BadRequest(f"{len(ranges)} ranges posted for a model of {len(sizes)} tensors")
        if not all(math.isfinite(r) and r > 0 for r in ranges) or not (noise_span >= 0):
            raise BadRequest("a shared grid's ranges must be positive numbers")
        r = np.asarray(ranges, dtype=np.float64)
        spans = {o: share * r + noise_span for o, share in shares.items()}
        step = sum(spans.values()) / levels
        limit = None if owner is None else np.repeat(np.ceil(spans[owner] / step), sizes)
        return cls(np.repeat(step, sizes), cls.bits_for(levels, len(shares)), limit)

    def encode(self, values: np.ndarray) -> np.ndarray:
        """This owner's codes mod 2^ring_bits (uint32): each value rounded to the grid, within its limit."""
        if self.limit is None:
            raise BadRequest("the aggregator's grid only decodes")
        values = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise BadRequest("a vector with NaN or infinite values cannot be encoded")
        q = np.clip(np.rint(values / self.step), -self.limit, self.limit).astype(np.int64)
        return (q % (1 << self.ring_bits)).astype(np.uint32)

    def decode_sum(self, total: np.ndarray, count: int = 1) -> np.ndarray:
        """The float sum of encoded vectors whose ring sum is ``total`` (read as signed; ``count`` is
        bounded by the grid's construction, not needed here)."""
        modulus = 1 << self.ring_bits
        signed = total.astype(np.int64) % modulus
        signed = np.where(signed >= modulus // 2, signed - modulus, signed)
        return signed * self.step
