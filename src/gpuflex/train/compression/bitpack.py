"""Unsigned integer codes <-> a dense stream of bytes: sub-byte codes and top-k indices cost only their bits.

Code ``i`` of ``bits`` bits occupies bits ``[i·bits, (i+1)·bits)`` of the stream, least significant bit
first; the stream is ``packed_size(n, bits)`` bytes, zero-padded. Eight codes of ``bits`` bits fill
exactly ``bits`` bytes, so both directions work on groups of eight: a loop over the eight places in a
group and the (at most three) bytes each place touches, every step one vectorised op over all groups.
Widths that divide 8 (1, 2, 4, 8: the dense codes) take a shorter path on uint8 alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_BITS = 16  # top-k's largest chunk, 65,536 values, needs 16-bit indices


def packed_size(count: int, bits: int) -> int:
    """Bytes taken by ``count`` codes of ``bits`` bits."""
    return -(-count * bits // 8)


def _places(bits: int) -> list[tuple[int, int, range]]:
    """For each of the eight codes in a group: its first byte, its bit offset there, the bytes it touches."""
    places = []
    for i in range(8):
        first, shift = divmod(i * bits, 8)
        places.append((first, shift, range(first, (i * bits + bits - 1) // 8 + 1)))
    return places


def pack(codes: Tensor, bits: int) -> Tensor:
    """``codes`` (integers in ``[0, 2**bits)``, any shape) as a flat uint8 stream."""
    assert 1 <= bits <= MAX_BITS, f"cannot pack {bits}-bit codes"
    if 8 % bits == 0:  # whole codes per byte: plain uint8 shifts, the common case (int2, int4, int8)
        per = 8 // bits
        rows = F.pad(codes.reshape(-1).to(torch.uint8), (0, -codes.numel() % per)).view(-1, per)
        out = rows[:, 0].clone()
        for i in range(1, per):
            out |= rows[:, i] << (i * bits)
        return out
    # int64, not the narrowest type that holds a shifted code: this torch's int16 and int32 shifts
    # run 10-50x slower than int64's on CPU
    n = codes.numel()
    groups = F.pad(codes.reshape(-1).long(), (0, -n % 8)).view(-1, 8).t().contiguous()
    out = torch.zeros(bits, groups.shape[1], dtype=torch.long)
    for i, (first, shift, touched) in enumerate(_places(bits)):
        word = groups[i] << shift
        for byte in touched:
            out[byte] |= (word >> (8 * (byte - first))) & 0xFF
    return out.t().reshape(-1).to(torch.uint8)[: packed_size(n, bits)]


def unpack(data: Tensor, bits: int, count: int) -> Tensor:
    """The ``count`` codes in ``data`` (``packed_size(count, bits)`` uint8): uint8 if ``bits`` divides 8,
    else int64."""
    assert 1 <= bits <= MAX_BITS, f"cannot unpack {bits}-bit codes"
    assert data.dtype == torch.uint8 and data.numel() == packed_size(count, bits), "stream of the wrong size"
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        return ((data[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]
    groups = -(-count // 8)
    stream = F.pad(data.long(), (0, groups * bits - data.numel())).view(groups, bits)
    stream = stream.t().contiguous()
    out = torch.empty(8, groups, dtype=torch.long)
    for i, (first, shift, touched) in enumerate(_places(bits)):
        word = stream[first].clone()
        for byte in touched[1:]:
            word |= stream[byte] << (8 * (byte - first))
        out[i] = (word >> shift) & ((1 << bits) - 1)
    return out.t().reshape(-1)[:count]
