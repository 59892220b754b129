"""Pseudo-gradient compression: the codecs, their wire format, and error feedback.

``get_compressor(spec)`` builds the ``Compressor`` a ``CompressionSpec`` names (or a method name:
``get_compressor("int8")``); ``ErrorFeedback`` wraps one so that what a lossy codec drops is sent later.

=======  ==============================================  ===========================================
method   what is sent                                    bytes / fp32 (1M Gaussian values, defaults)
=======  ==============================================  ===========================================
none     fp32, exact                                     1
fp16     half precision, relative error <= 2^-11         0.50
bf16     bfloat16, relative error <= 2^-8                0.50
int8     blockwise absmax int8                           0.252
int4     blockwise int4, fitted scales                   0.127
int2     blockwise sign × {small, large}, fitted         0.0645
topk     top ``density`` of each chunk, packed indices,  0.0094 at 2% + int2
         values in any of the codecs above
=======  ==============================================  ===========================================

Map of the files:

- ``base``      the ``ValueCodec`` and ``Compressor`` interfaces, ``Dense``, the wire format and its checks
- ``floats``    the cast codecs: none (fp32), fp16, bf16
- ``quant``     the blockwise integer codecs: int8, int4, int2 (their error bounds, and why these levels)
- ``topk``      chunked top-k with bit-packed indices
- ``bitpack``   integer codes <-> a dense bit stream
- ``feedback``  ``ErrorFeedback``
"""

from __future__ import annotations

from typing import get_args

from pydantic import ValidationError

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import Codec, CompressionSpec, describe_validation_error
from gpuflex.train.compression.base import Compressor, Dense, ValueCodec
from gpuflex.train.compression.feedback import ErrorFeedback, with_residual
from gpuflex.train.compression.floats import Bf16, Fp16, Fp32
from gpuflex.train.compression.quant import Int2, Int4, Int8
from gpuflex.train.compression.topk import TopK

__all__ = [
    "CODECS",
    "Bf16",
    "Compressor",
    "Dense",
    "ErrorFeedback",
    "Fp16",
    "Fp32",
    "Int2",
    "Int4",
    "Int8",
    "TopK",
    "ValueCodec",
    "get_compressor",
    "with_residual",
]

CODECS: dict[str, type[ValueCodec]] = {c.name: c for c in (Fp32, Fp16, Bf16, Int8, Int4, Int2)}
assert set(CODECS) == set(get_args(Codec)), "every codec the spec names needs an implementation"


def get_compressor(spec: CompressionSpec | str) -> Compressor:
    """The compressor ``spec`` describes (a string: that method, default settings); BadRequest if invalid."""
    try:
        spec = CompressionSpec.model_validate(spec)
    except ValidationError as err:
        raise BadRequest(
            f"unknown compression {spec!r}: {describe_validation_error(err, CompressionSpec)}"
        ) from None
    if spec.method == "topk":
        return TopK(CODECS[spec.values](), spec.density, spec.block_size)
    return Dense(CODECS[spec.method](), spec.block_size)
