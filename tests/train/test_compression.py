import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from gpuflex.errors import BadRequest
from gpuflex.train.checkpoint import load_tensors, save_tensors
from gpuflex.train.compression import ErrorFeedback, Int8Settings, get_compressor

BLOCK = Int8Settings().block_size


def tensors(max_abs: float) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """Dicts of 1-3 fp32 tensors of any shape (scalars and empty ones too), finite values."""
    max_abs = float(np.float32(max_abs))  # a bound hypothesis can represent at width 32
    values = st.floats(-max_abs, max_abs, width=32, allow_nan=False, allow_infinity=False)
    array = arrays(np.float32, array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40), elements=values)
    return st.dictionaries(
        st.sampled_from(["w", "layer.0.bias", "h.attn.c_proj.weight"]), array, min_size=1
    ).map(lambda d: {k: torch.from_numpy(v.copy()) for k, v in d.items()})


def _round_trip(name: str, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    codec = get_compressor(name)
    out = codec.decompress(codec.compress(data))
    assert out.keys() == data.keys()
    for k, v in out.items():
        assert v.shape == data[k].shape and v.dtype == torch.float32
    return out


@settings(deadline=None)  # the first call pays torch's warm-up
@given(tensors(max_abs=3e38))
def test_none_is_exact(data):
    out = _round_trip("none", data)
    assert all(torch.equal(out[k], v) for k, v in data.items())


@settings(deadline=None)
@given(tensors(max_abs=60_000))
def test_fp16_is_within_half_precision(data):
    out = _round_trip("fp16", data)
    for k, v in data.items():
        # round to nearest: relative error 2^-11 for normal numbers, half a subnormal step (2^-25) below
        assert ((out[k] - v).abs() <= v.abs() * 2**-11 + 2**-25).all()


@settings(deadline=None)
@given(tensors(max_abs=1e6))
def test_int8_error_is_within_a_step_of_its_block(data):
    out = _round_trip("int8", data)
    for k, v in data.items():
        flat = v.flatten()
        err = (out[k].flatten() - flat).abs()
        blocks = torch.arange(flat.numel()) // BLOCK  # the block of each element
        absmax = torch.zeros(blocks.max().item() + 1 if flat.numel() else 0).scatter_reduce(
            0, blocks, flat.abs(), reduce="amax"
        )
        assert (err <= absmax[blocks] / 127 * (1 + 1e-5) + 1e-30).all()


@settings(max_examples=25, deadline=None)
@given(st.floats(-100, 100, allow_nan=False, width=32).filter(lambda x: x != 0))
def test_int8_keeps_zeros_and_block_extremes_exactly(x):
    t = torch.zeros(2 * BLOCK)
    t[3] = x
    out = _round_trip("int8", {"t": t})["t"]
    assert out[3] == pytest.approx(x, rel=1e-6)  # the absmax itself maps to ±127 · absmax / 127
    assert (out[torch.arange(2 * BLOCK) != 3] == 0).all()


def test_int8_is_at_least_3x_smaller_than_fp32_and_fp16_about_2x():
    delta = {"w": torch.randn(100_000)}
    sizes = {name: len(get_compressor(name).compress(delta)) for name in ("none", "fp16", "int8")}
    assert sizes["none"] >= 400_000
    assert sizes["none"] / sizes["int8"] >= 3
    assert 1.9 <= sizes["none"] / sizes["fp16"] <= 2.1


def test_fp16_clamps_instead_of_overflowing():
    out = _round_trip("fp16", {"w": torch.tensor([1e6, -1e6])})["w"]
    assert torch.isfinite(out).all()
    assert out.tolist() == [65504.0, -65504.0]


@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
def test_decoding_another_codecs_blob_is_a_bad_request(name):
    other = "int8" if name != "int8" else "none"
    blob = get_compressor(other).compress({"w": torch.ones(3)})
    with pytest.raises(BadRequest, match=f"compressed with '{other}'"):
        get_compressor(name).decompress(blob)


@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
def test_garbage_is_a_bad_request(name):
    with pytest.raises(BadRequest):
        get_compressor(name).decompress(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")


def test_int8_blob_with_tampered_shapes_is_a_bad_request():
    codec = get_compressor("int8")
    tensors, metadata = load_tensors(codec.compress({"w": torch.randn(300)}))
    for shapes in ({"w": [301]}, {"w": [-300]}, {"v": [300]}, ["w"], {"w": ["x"]}):
        blob = save_tensors(tensors, {**metadata, "shapes": json.dumps(shapes)})
        with pytest.raises(BadRequest, match="malformed int8 blob"):
            codec.decompress(blob)
    for block in ("0", "-5", "many"):
        with pytest.raises(BadRequest, match="malformed int8 blob"):
            codec.decompress(save_tensors(tensors, {**metadata, "block_size": block}))


def test_unknown_compression_is_a_bad_request():
    with pytest.raises(BadRequest, match="unknown compression 'zip'"):
        get_compressor("zip")


@pytest.mark.parametrize("name", ["fp16", "int8"])
def test_error_feedback_keeps_the_sum_sent_on_track(name):
    torch.manual_seed(0)
    codec = get_compressor(name)
    delta = {"w": torch.randn(4096) * 1e-3, "b": torch.randn(7) * 1e-3}
    feedback = ErrorFeedback(codec)
    sent = {k: torch.zeros_like(v) for k, v in delta.items()}
    naive = {k: torch.zeros_like(v) for k, v in delta.items()}
    one_step = max((delta[k] - codec.decompress(codec.compress(delta))[k]).abs().max() for k in delta)
    for rounds in range(1, 21):
        received = codec.decompress(feedback.compress(delta))
        lossy = codec.decompress(codec.compress(delta))
        for k, v in delta.items():
            sent[k] += received[k]
            naive[k] += lossy[k]
            # what has arrived differs from what should have by exactly the residual, which stays small
            assert torch.allclose(sent[k] + feedback.residual[k], v * rounds, atol=1e-9, rtol=1e-5)
            assert (v * rounds - sent[k]).abs().max() <= 2 * one_step + 1e-9
    drift = max((naive[k] - delta[k] * 20).abs().max() for k in delta)
    tracked = max((sent[k] - delta[k] * 20).abs().max() for k in delta)
    assert tracked < drift / 4  # without feedback the error grows with every round


def test_error_feedback_revert_forgets_the_last_compression():
    feedback = ErrorFeedback(get_compressor("int8"))
    delta = {"w": torch.randn(1000)}
    feedback.compress(delta)
    kept = {k: v.clone() for k, v in feedback.residual.items()}
    feedback.compress({"w": torch.randn(1000)})
    feedback.revert()
    assert torch.equal(feedback.residual["w"], kept["w"])


def test_error_feedback_with_lossless_codec_has_no_residual():
    feedback = ErrorFeedback(get_compressor("none"))
    feedback.compress({"w": torch.randn(100)})
    assert torch.count_nonzero(feedback.residual["w"]) == 0
