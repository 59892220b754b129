"""The cast codecs: fp32 (``none``), fp16 and bf16. One part, ``values``; no blocks, no scales.

Casting rounds to nearest, so the relative error is at most 2^-11 for fp16 and 2^-8 for bf16 (for
fp16 values below 2^-14, subnormals, the error is at most 2^-25 absolute). Magnitudes beyond the
target's largest finite value are clamped to it rather than becoming inf: 65,504 for fp16,
about 3.39e38 for bf16.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from gpuflex.train.compression.base import Parts, ValueCodec, take


class _Cast(ValueCodec):
    dtype: ClassVar[torch.dtype]
    scaled = False

    def encode(self, flat: Tensor, block: int) -> Parts:
        limit = torch.finfo(self.dtype).max
        return {"values": flat.clamp(-limit, limit).to(self.dtype)}

    def decode(self, parts: Parts, numel: int, block: int) -> Tensor:
        return take(parts, "values", self.dtype, numel).float()


class Fp32(_Cast):
    """Lossless: 4 bytes a value."""

    name = "none"
    dtype = torch.float32

    def encode(self, flat: Tensor, block: int) -> Parts:
        return {"values": flat}


class Fp16(_Cast):
    """2 bytes a value; relative error <= 2^-11, range ±65,504."""

    name = "fp16"
    dtype = torch.float16


class Bf16(_Cast):
    """2 bytes a value; relative error <= 2^-8, fp32's range."""

    name = "bf16"
    dtype = torch.bfloat16
