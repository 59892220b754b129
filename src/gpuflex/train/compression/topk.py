"""Chunked top-k sparsification: of every chunk of ``block_size`` values keep the ``density`` largest.

Each tensor is split into chunks of ``block_size`` consecutive values (the last one may be shorter);
a chunk of ``n`` values keeps its ``ceil(density·n)`` values of largest magnitude and zeroes the rest.
Per tensor the parts are ``idx``, the kept values' in-chunk positions, ascending within each chunk,
bit-packed at ``ceil(log2(block_size))`` bits each, and the parts of the kept values encoded with a
value codec (``values``) in blocks of one chunk's worth, so a scaled codec gets one scale per chunk.
SparseLoCo sends this combination; with 2% density and int2 values in chunks of 256, a chunk costs
6 bytes of indices, 1.5 of values and 2 of scale: about 1/108 of fp32.

Chunking rather than a global top-k keeps indices short (8 bits, not 27, for 100M parameters), costs
one ``torch.topk`` over a (chunks, block_size) matrix, and spreads what is sent over the whole tensor;
error feedback delivers what a chunk leaves out in a later round. Because a chunk's indices are
strictly increasing and below its length, a decoder can reject duplicates and out-of-range positions
before scattering, which makes the scatter well defined and deterministic.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gpuflex.errors import BadRequest
from gpuflex.train.compression.base import Compressor, Parts, ValueCodec, take
from gpuflex.train.compression.bitpack import pack, packed_size, unpack


class TopK(Compressor):
    name = "topk"

    def __init__(self, values: ValueCodec, density: float = 0.02, block_size: int = 256):
        assert 0 < density <= 1, f"density {density}"
        assert 2 <= block_size <= 65536, f"block_size {block_size}"
        self.values = values
        self.density = density
        self.block_size = block_size
        self.index_bits = (block_size - 1).bit_length()

    @property
    def params(self) -> dict[str, object]:
        return {"density": self.density, "values": self.values.name, "block_size": self.block_size}

    def keep(self, n: int) -> int:
        """Values kept of a chunk of ``n``: ``ceil(density·n)`` (rounded first, so 7% of 100 is 7, not 8),
        and at least one."""
        return max(1, math.ceil(round(self.density * n, 9)))

    def _segments(self, numel: int) -> list[tuple[int, int, int]]:
        """(chunks, chunk length, kept per chunk): the whole chunks, then the short last one if any."""
        full, rest = divmod(numel, self.block_size)
        segments = [(full, self.block_size, self.keep(self.block_size)), (1, rest, self.keep(rest))]
        return [seg for seg in segments if seg[0] and seg[1]]

    def encode(self, flat: Tensor) -> Parts:
        indices, values, start = [torch.zeros(0, dtype=torch.long)], [flat[:0]], 0
        for chunks, length, kept in self._segments(flat.numel()):
            matrix = flat[start : start + chunks * length].view(chunks, length)
            idx = matrix.abs().topk(kept, dim=1, sorted=False).indices.sort(dim=1).values
            indices.append(idx.view(-1))
            values.append(matrix.gather(1, idx).view(-1))
            start += chunks * length
        encoded = self.values.encode(torch.cat(values), self.keep(self.block_size))
        return {"idx": pack(torch.cat(indices), self.index_bits), **encoded}

    def decode(self, parts: Parts, numel: int) -> Tensor:
        segments = self._segments(numel)
        count = sum(chunks * kept for chunks, _, kept in segments)
        packed = take(parts, "idx", torch.uint8, packed_size(count, self.index_bits))
        idx = unpack(packed, self.index_bits, count).long()
        values = self.values.decode(parts, count, self.keep(self.block_size))
        out, start = [torch.zeros(0)], 0
        for chunks, length, kept in segments:
            end = start + chunks * kept
            out.append(
                _scatter(idx[start:end].view(chunks, kept), values[start:end].view(chunks, kept), length)
            )
            start = end
        return torch.cat(out)


def _scatter(idx: Tensor, values: Tensor, length: int) -> Tensor:
    """Chunks of ``length`` zeros with ``values`` at ``idx``, which must ascend strictly and stay below it."""
    if (idx[:, -1] >= length).any() or (idx[:, 1:] <= idx[:, :-1]).any():
        raise BadRequest(f"indices must ascend strictly within each chunk and stay below {length}")
    return torch.zeros(idx.shape[0], length).scatter_(1, idx, values).view(-1)
