"""One suite over every compressor (round trips, echo, wire bytes, error feedback, hostile blobs), then
each codec's own error bound, top-k's selection, and the bit packing underneath."""

import json
import math

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import CompressionSpec
from gpuflex.train.checkpoint import load_tensors
from gpuflex.train.compression import CODECS, Dense, ErrorFeedback, TopK, get_compressor
from gpuflex.train.compression.bitpack import pack, packed_size, unpack


def topk(density: float, values: str, block_size: int = 256) -> CompressionSpec:
    return CompressionSpec(method="topk", density=density, values=values, block_size=block_size)


DENSE = ["none", "fp16", "bf16", "int8", "int4", "int2"]
SPECS = [
    *(CompressionSpec(method=m) for m in DENSE),
    CompressionSpec(method="int4", block_size=100),  # blocks that do not divide the tensors
    topk(0.02, "int2"),  # SparseLoCo's combination
    topk(0.01, "int4"),
    topk(0.03, "fp16"),
    topk(0.1, "bf16", block_size=1000),  # 10-bit indices: the general packing path
    topk(0.05, "int8", block_size=65536),  # 16-bit indices
    topk(0.5, "none", block_size=8),  # 3-bit indices, exact values
]
LOSSY = [s for s in SPECS if s.method != "none"]


def _id(spec: CompressionSpec) -> str:
    return f"{spec.label}/{spec.block_size}"


every_spec = pytest.mark.parametrize("spec", SPECS, ids=_id)
TINY = 1e-37  # absolute slack: scales are bf16, whose subnormals stop near 1e-40 (times up to 127 levels)


def tensors(max_abs: float = 1e38) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """Dicts of 1-3 fp32 tensors of any shape (scalars and empty ones too), finite values."""
    max_abs = float(np.float32(max_abs))  # a bound hypothesis can represent at width 32
    values = st.floats(-max_abs, max_abs, width=32, allow_nan=False, allow_infinity=False)
    array = arrays(np.float32, array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=30), elements=values)
    return st.dictionaries(
        st.sampled_from(["w", "layer.0.bias", "h.attn.c_proj.weight", "odd:name"]), array, min_size=1
    ).map(lambda d: {k: torch.from_numpy(v.copy()) for k, v in d.items()})


def awkward() -> dict[str, torch.Tensor]:
    """Every awkward case at once: empty, scalar, 1 element, not a multiple of a block, zeros, huge, tiny."""
    torch.manual_seed(0)
    return {
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(-2.5),
        "one": torch.tensor([3.0]),
        "ragged": torch.randn(3, 7, 13),
        "zeros": torch.zeros(300),
        "huge": torch.randn(300) * 1e37,
        "tiny": torch.randn(300) * 1e-30,
        "mixed": torch.cat([torch.randn(10) * 1e30, torch.randn(10) * 1e-30]),
    }


def _round_trip(spec: CompressionSpec | str, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    codec = get_compressor(spec)
    return codec.decompress(codec.compress(data))


def _relative_error(out: torch.Tensor, x: torch.Tensor) -> float:
    return float((out.double() - x.double()).norm() / x.double().norm())


# --- the shared suite ---------------------------------------------------------------------------------


@every_spec
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=tensors())
def test_round_trip_keeps_names_shapes_and_order_and_echo_is_exact(spec, data):
    codec = get_compressor(spec)
    blob, echo = codec.compress_with_echo(data)
    out = codec.decompress(blob)
    assert list(out) == list(data)
    bare = codec.echo(data)  # an auditor's: no blob built
    for k, v in out.items():
        assert v.shape == data[k].shape and v.dtype == torch.float32
        assert torch.isfinite(v).all()
        assert torch.equal(v, echo[k])  # what the sender applies is what every receiver decodes
        assert torch.equal(v, bare[k])


@every_spec
def test_awkward_tensors_round_trip_within_a_fraction_of_their_size(spec):
    codec = get_compressor(spec)
    data = awkward()
    out = codec.decompress(codec.compress(data), shapes={k: v.shape for k, v in data.items()})
    assert (out["zeros"] == 0).all() and out["empty"].shape == (0, 4)
    fp16 = "fp16" in (spec.method, spec.values if spec.method == "topk" else None)
    for k in ("huge",) if fp16 else ("huge", "tiny"):  # fp16 flushes values below 2^-24 to zero
        # topk keeps few entries, so only the whole-tensor error is bounded: by the part it drops
        target = data[k].clamp(-65504, 65504) if fp16 else data[k]  # and clamps those beyond 65504
        assert _relative_error(out[k], target) < (1.0 if spec.method == "topk" else 0.6)


@every_spec
def test_decoding_is_deterministic(spec):
    codec = get_compressor(spec)
    blob = codec.compress({"w": torch.randn(5000), "b": torch.randn(3)})
    first, second = codec.decompress(blob), get_compressor(spec).decompress(blob)
    assert all(torch.equal(first[k], second[k]) for k in first)


@every_spec
def test_a_non_finite_or_out_of_range_delta_is_refused_before_it_is_sent(spec):
    codec = get_compressor(spec)
    for bad in (float("nan"), float("inf"), -3e38):
        with pytest.raises(ValueError, match="'w' has values that are not finite"):
            codec.compress({"b": torch.ones(2), "w": torch.tensor([1.0, bad])})


# --- wire bytes ---------------------------------------------------------------------------------------

N_WIRE = 1_000_000


@pytest.fixture(scope="module")
def gaussian() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(N_WIRE, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [
        (CompressionSpec(method="none"), 1.0, 1.001),
        (CompressionSpec(method="fp16"), 0.5, 0.501),
        (CompressionSpec(method="bf16"), 0.5, 0.501),
        (CompressionSpec(method="int8"), 0.25, 0.255),  # 1 byte + 2/256 of a scale per 4 bytes
        (CompressionSpec(method="int4"), 0.125, 0.15),
        (CompressionSpec(method="int2"), 0.0625, 0.08),
        (topk(0.02, "int2"), 0.009, 0.01),  # a chunk of 256: 6 index bytes, 1.5 of values, 2 of scale
        (topk(0.01, "int2"), 0.005, 0.006),  # 3 + 0.75 + 2 bytes a chunk
    ],
    ids=lambda p: p.label if isinstance(p, CompressionSpec) else None,
)
def test_bytes_on_the_wire_headers_and_indices_included(gaussian, spec, low, high):
    ratio = len(get_compressor(spec).compress(gaussian)) / (4 * N_WIRE)
    assert low <= ratio <= high


# --- codec error bounds -------------------------------------------------------------------------------


def _blob_parts(blob: bytes, name: str) -> dict[str, torch.Tensor]:
    tensors, _ = load_tensors(blob)
    return {k.rpartition(":")[2]: v for k, v in tensors.items() if k.rpartition(":")[0] == name}


def _quant_bound(method: str, x: torch.Tensor, parts: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """Each value's error bound as the quant module documents it, from the scales the blob holds."""
    s = parts["scale"].double().repeat_interleave(block)[: x.numel()]
    mag = x.double().abs()
    if method == "int8":
        return s / 2
    if method == "int4":
        return torch.maximum(s / 2, mag - 7 * s)
    r = float(parts["ratio"])
    return torch.maximum(s * max(r, (1 - r) / 2), mag - s)


@pytest.mark.parametrize("method", ["int8", "int4", "int2"])
@pytest.mark.parametrize("block", [8, 100, 256])
@settings(max_examples=40, deadline=None)
@given(data=tensors())
def test_integer_codecs_stay_within_their_bound_relative_to_the_block_scale(method, block, data):
    codec = get_compressor(CompressionSpec(method=method, block_size=block))
    blob = codec.compress(data)
    out = codec.decompress(blob)
    for k, v in data.items():
        x = v.flatten()
        bound = _quant_bound(method, x, _blob_parts(blob, k), block)
        err = (out[k].flatten().double() - x.double()).abs()
        assert (err <= bound * (1 + 1e-6) + TINY).all()


def test_int8_scale_is_the_block_absmax_over_127():
    x = torch.randn(1000)
    parts = _blob_parts(get_compressor("int8").compress({"w": x}), "w")
    absmax = torch.nn.functional.pad(x.abs(), (0, 24)).view(-1, 256).amax(dim=1)
    assert torch.allclose(parts["scale"].float(), absmax / 127, rtol=2**-8)


@pytest.mark.parametrize(
    ("method", "most"),
    [("none", 0.0), ("fp16", 2**-11), ("bf16", 2**-8), ("int8", 0.0075), ("int4", 0.122), ("int2", 0.342)],
)
def test_relative_error_on_gaussian_blocks(gaussian, method, most):
    """The fitted scales are the point: absmax int4 gives 0.126 here; int2 with r fixed at 1/3, like the
    4-level Lloyd-Max quantiser of a Gaussian, 0.343 (ours: 0.341)."""
    assert _relative_error(_round_trip(method, gaussian)["w"], gaussian["w"]) <= most


@pytest.mark.parametrize("method", ["fp16", "bf16"])
@settings(max_examples=60, deadline=None)
@given(data=tensors())
def test_casts_round_to_nearest(method, data):
    out = _round_trip(method, data)
    eps, smallest, limit = {"fp16": (2**-11, 2**-25, 65504.0), "bf16": (2**-8, 2**-134, 3.3895e38)}[method]
    for k, v in data.items():
        clamped = v.double().clamp(-limit, limit)
        assert ((out[k].double() - clamped).abs() <= clamped.abs() * eps + smallest).all()


@settings(max_examples=60, deadline=None)
@given(data=tensors())
def test_none_is_exact(data):
    out = _round_trip("none", data)
    assert all(torch.equal(out[k], v) for k, v in data.items())


def test_int2_fits_its_small_level_to_the_data():
    """r is fitted per tensor: ~0.3 on Gaussian blocks, much larger on top-k's kept values (all large)."""
    x = torch.randn(100_000)
    dense = _blob_parts(get_compressor("int2").compress({"w": x}), "w")
    sparse = _blob_parts(get_compressor(topk(0.02, "int2")).compress({"w": x}), "w")
    assert 0.25 <= float(dense["ratio"]) <= 0.35
    assert 0.6 <= float(sparse["ratio"]) <= 0.95


# --- top-k ----------------------------------------------------------------------------------------------


@st.composite
def topk_cases(draw):
    """A tensor of distinct magnitudes (no ties), and top-k settings."""
    n = draw(st.integers(0, 3000))
    block = draw(st.sampled_from([8, 13, 64, 256, 1000]))
    density = draw(st.sampled_from([0.01, 0.02, 0.03, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    x = (torch.randperm(n, generator=g).float() + 1) * sign * draw(st.sampled_from([1e-20, 1e-3, 1.0, 1e20]))
    return x, block, density


def _reference_support(x: torch.Tensor, block: int, density: float) -> torch.Tensor:
    keep = torch.zeros(x.numel(), dtype=torch.bool)
    for start in range(0, x.numel(), block):
        chunk = x[start : start + block].abs()
        k = math.ceil(round(density * chunk.numel(), 9))
        keep[start + chunk.topk(k).indices] = True
    return keep


@settings(max_examples=150, deadline=None)
@given(topk_cases())
def test_topk_keeps_exactly_the_largest_of_each_chunk_and_zeroes_the_rest(case):
    x, block, density = case
    out = _round_trip(topk(density, "none", block), {"w": x})["w"]
    keep = _reference_support(x, block, density)
    assert torch.equal(out[keep], x[keep])
    assert (out[~keep] == 0).all()


@pytest.mark.parametrize("values", ["int8", "int4", "int2", "fp16"])
@settings(max_examples=60, deadline=None)
@given(case=topk_cases())
def test_topk_values_are_within_their_codecs_bound_with_one_scale_per_chunk(values, case):
    x, block, density = case
    codec = get_compressor(topk(density, values, block))
    blob = codec.compress({"w": x})
    out = codec.decompress(blob)["w"]
    keep = _reference_support(x, block, density)
    assert (out[~keep] == 0).all()
    kept = x[keep].double()  # chunk by chunk, ascending position: the order the blob holds them in
    if values == "fp16":  # rounded to nearest, clamped to its range
        target = kept.clamp(-65504, 65504)
        assert ((out[keep].double() - target).abs() <= target.abs() * 2**-11 + 2**-25).all()
        return
    err = (out[keep].double() - kept).abs()
    per_chunk = math.ceil(round(density * block, 9))
    parts = _blob_parts(blob, "w")
    assert parts["scale"].numel() == -(-x.numel() // block)  # one scale per chunk
    assert (err <= _quant_bound(values, kept, parts, per_chunk) * (1 + 1e-6) + TINY).all()


def test_topk_short_last_chunk_keeps_its_own_share():
    """300 values, chunks of 256, 2%: ceil(5.12) = 6 kept of the first chunk, ceil(0.88) = 1 of the last."""
    x = torch.randn(300)
    out = _round_trip(topk(0.02, "none"), {"w": x})
    assert torch.count_nonzero(out["w"][:256]) == 6 and torch.count_nonzero(out["w"][256:]) == 1


def test_topk_density_rounds_so_seven_percent_of_a_hundred_is_seven():
    codec = TopK(CODECS["none"](), density=0.07, block_size=100)  # 0.07 * 100 == 7.000000000000001
    assert [codec.keep(n) for n in (100, 1, 15, 14)] == [7, 1, 2, 1]


# --- error feedback -------------------------------------------------------------------------------------


def _rounds(spec, rounds: int, decay: float = 1.0, feedback: bool = True, n: int = 1024):
    """Send Δ_t = μ + noise for ``rounds`` rounds; after each, yield (Δ sum, sum received, ErrorFeedback).
    Without ``feedback`` each Δ is compressed on its own (the ErrorFeedback is then unused)."""
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(n, generator=g) * 1e-3
    codec = get_compressor(spec)
    sender = ErrorFeedback(codec, decay)
    true, sent = torch.zeros(n), torch.zeros(n)
    for _ in range(rounds):
        delta = {"w": mean + torch.randn(n, generator=g) * 1e-3}
        true += delta["w"]
        sent += codec.decompress(sender.compress(delta) if feedback else codec.compress(delta))["w"]
        yield true, sent, sender


@pytest.mark.parametrize("spec", [*SPECS, topk(0.01, "int2")], ids=_id)
def test_error_feedback_keeps_the_sum_sent_on_track(spec):
    rounds = 300
    norms = []
    for true, sent, feedback in _rounds(spec, rounds):
        residual = feedback.residual["w"]
        # what has arrived differs from what should have by exactly the residual...
        assert torch.allclose(sent + residual, true, rtol=1e-4, atol=1e-7)
        norms.append(float(residual.norm()))
    # ...which stops growing (it would grow with every round if what compression dropped were lost)
    assert max(norms[2 * rounds // 3 :]) <= 1.25 * max(norms[rounds // 3 : 2 * rounds // 3]) + 1e-9
    assert _relative_error(sent, true) < 0.2  # topk 1%: a residual of ~35 rounds' worth, after 300


@pytest.mark.parametrize("spec", LOSSY, ids=_id)
def test_without_error_feedback_the_loss_accumulates(spec):
    *_, (true, naive, _) = _rounds(spec, 100, feedback=False)
    *_, (true, sent, _) = _rounds(spec, 100)
    assert _relative_error(sent, true) <= _relative_error(naive, true) / 2 + 1e-6


def test_decay_shrinks_the_residual():
    spec = topk(0.01, "int2")
    plain = max(float(f.residual["w"].norm()) for *_, f in _rounds(spec, 200))
    decayed = max(float(f.residual["w"].norm()) for *_, f in _rounds(spec, 200, decay=0.8))
    assert decayed < plain / 3
    # with nothing new to send, each round at least multiplies what is left by the decay
    feedback = ErrorFeedback(get_compressor(spec), decay=0.5)
    feedback.compress({"w": torch.randn(4096)})
    for _ in range(5):
        before = feedback.residual["w"].norm()
        feedback.compress({"w": torch.zeros(4096)})
        assert feedback.residual["w"].norm() <= 0.5 * before + 1e-6


@every_spec
def test_error_feedback_echo_is_what_receivers_decode(spec):
    """The aggregator's downlink: it applies the echo, the workers decode the blob; they must agree."""
    feedback = ErrorFeedback(get_compressor(spec), decay=0.9)
    for _ in range(3):
        delta = {"w": torch.randn(40, 50), "b": torch.randn(7)}
        blob, echo = feedback.compress_with_echo(delta)
        decoded = get_compressor(spec).decompress(blob)
        assert all(torch.equal(decoded[k], echo[k]) for k in delta)


def test_error_feedback_revert_forgets_the_last_compression():
    feedback = ErrorFeedback(get_compressor("int2"))
    feedback.compress({"w": torch.randn(1000)})
    kept = feedback.residual["w"].clone()
    feedback.compress({"w": torch.randn(1000)})
    assert not torch.equal(feedback.residual["w"], kept)
    assert feedback.compressions == 2
    feedback.revert()
    assert torch.equal(feedback.residual["w"], kept)
    assert feedback.compressions == 1  # the count a worker commits to (its chain) forgets it too


def test_error_feedback_does_not_alias_the_callers_delta():
    delta = {"w": torch.randn(100)}
    original = delta["w"].clone()
    _, echo = ErrorFeedback(get_compressor("none")).compress_with_echo(delta)
    echo["w"] += 1
    assert torch.equal(delta["w"], original)


def test_error_feedback_with_lossless_codec_has_no_residual():
    feedback = ErrorFeedback(get_compressor("none"))
    feedback.compress({"w": torch.randn(100)})
    assert torch.count_nonzero(feedback.residual["w"]) == 0


# --- hostile blobs ----------------------------------------------------------------------------------------


def _retamper(blob: bytes, tensors=None, **metadata: str) -> bytes:
    """``blob`` re-saved with some of its tensors or metadata replaced."""
    old, meta = load_tensors(blob)
    return safetensors.torch.save({**old, **(tensors or {})}, {**meta, **metadata})


@every_spec
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 40), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255))))
def test_damaged_blobs_decode_or_are_a_bad_request_never_a_crash(spec, cut, flips):
    codec = get_compressor(spec)
    blob = bytearray(codec.compress({"w": torch.randn(600), "s": torch.tensor(1.0)}))
    for at, xor in flips:
        blob[at % len(blob)] ^= xor
    try:
        out = codec.decompress(bytes(blob[: len(blob) - cut]))
    except BadRequest:
        return
    assert all(torch.isfinite(v).all() for v in out.values())


@every_spec
def test_every_truncation_is_a_bad_request(spec):
    codec = get_compressor(spec)
    blob = codec.compress({"w": torch.randn(40)})
    for end in range(len(blob)):
        with pytest.raises(BadRequest):
            codec.decompress(blob[:end])


@pytest.mark.parametrize("name", DENSE)
def test_decoding_another_methods_blob_is_a_bad_request(name):
    other = "int8" if name != "int8" else "none"
    blob = get_compressor(other).compress({"w": torch.ones(3)})
    with pytest.raises(BadRequest, match=f"compressed with '{other}', expected '{name}'"):
        get_compressor(name).decompress(blob)


@pytest.mark.parametrize(
    "theirs",
    [
        CompressionSpec(method="int4", block_size=128),
        topk(0.03, "int2"),
        topk(0.02, "int4"),
        topk(0.02, "int2", 512),
    ],
    ids=_id,
)
def test_decoding_with_other_settings_is_a_bad_request(theirs):
    ours = CompressionSpec(method="int4") if theirs.method == "int4" else topk(0.02, "int2")
    blob = get_compressor(theirs).compress({"w": torch.randn(1000)})
    with pytest.raises(BadRequest, match=f"compressed with {theirs.method} .*, expected"):
        get_compressor(ours).decompress(blob)


def test_a_receiver_can_pin_the_shapes_it_expects():
    codec = get_compressor("int8")
    blob = codec.compress({"w": torch.randn(3, 4)})
    assert codec.decompress(blob, shapes={"w": (3, 4)})["w"].shape == (3, 4)
    for shapes in ({"w": (4, 3)}, {"w": (3, 4), "b": (1,)}, {"v": (3, 4)}):
        with pytest.raises(BadRequest, match="blob holds shapes"):
            codec.decompress(blob, shapes=shapes)


BAD_SHAPES = ['{"w": [3000]}', '{"w": [-300]}', '{"v": [300]}', '["w"]', '{"w": ["x"]}', '{"w": [3.0e2]}']
BAD_SHAPES += ['{"w": [true]}', "not json", '{"w": [' + "9" * 5000 + "]}"]  # the last: too long an int


@pytest.mark.parametrize("method", ["int8", "topk"])
@pytest.mark.parametrize("shapes", BAD_SHAPES, ids=lambda shapes: shapes[:16])
def test_tampered_shapes_are_a_bad_request(method, shapes):
    blob = get_compressor(method).compress({"w": torch.randn(300)})
    with pytest.raises(BadRequest):
        get_compressor(method).decompress(_retamper(blob, shapes=shapes))


def test_missing_extra_or_mistyped_parts_are_a_bad_request():
    codec = get_compressor("int4")
    blob = codec.compress({"w": torch.randn(300)})
    tensors, _ = load_tensors(blob)
    cases = {
        "part 'scale' is missing": _without(blob, "w:scale"),
        "unexpected parts": _retamper(blob, {"w:extra": torch.zeros(1)}),
        "not in its shapes": _retamper(blob, {"v:codes": torch.zeros(1, dtype=torch.uint8)}),
        "expected 2 × torch.bfloat16": _retamper(blob, {"w:scale": tensors["w:scale"].float()}),
        "expected 150 × torch.uint8": _retamper(blob, {"w:codes": tensors["w:codes"][:-1]}),
    }
    for message, bad in cases.items():
        with pytest.raises(BadRequest, match=message):
            codec.decompress(bad)


def _without(blob: bytes, key: str) -> bytes:
    tensors, meta = load_tensors(blob)
    del tensors[key]
    return safetensors.torch.save(tensors, meta)


@pytest.mark.parametrize(
    ("method", "part", "value", "message"),
    [
        ("int8", "codes", 255, "codes must be at most 254"),
        ("int4", "codes", 0xFF, "codes must be at most 14"),
        ("int2", "scale", -1.0, "scales must be non-negative"),
        ("int8", "scale", float("nan"), "scales must be non-negative"),
        ("int2", "ratio", 1.5, r"ratio must be in \[0, 1\]"),
        ("int8", "scale", 3e38, "non-finite"),  # 127 × 3e38 overflows
        ("none", "values", float("inf"), "non-finite"),
    ],
)
def test_values_out_of_their_codecs_range_are_a_bad_request(method, part, value, message):
    codec = get_compressor(method)
    blob = codec.compress({"w": torch.randn(300)})
    tensors, _ = load_tensors(blob)
    tampered = tensors[f"w:{part}"].clone()
    tampered.view(-1)[0] = value
    with pytest.raises(BadRequest, match=message):
        codec.decompress(_retamper(blob, {f"w:{part}": tampered}))


@pytest.mark.parametrize(
    ("n", "edit"),
    [
        (300, lambda idx: idx.index_fill_(0, torch.tensor([6]), 250)),  # last chunk holds 44: 250 is outside
        (512, lambda idx: idx.index_fill_(0, torch.tensor([1]), int(idx[0]))),  # a duplicate
        (512, lambda idx: idx.copy_(idx.flip(0))),  # descending
    ],
    ids=["out of range", "duplicate", "unsorted"],
)
def test_topk_bad_indices_are_a_bad_request(n, edit):
    codec = get_compressor(topk(0.02, "int2"))  # 8-bit indices: one byte each
    blob = codec.compress({"w": torch.randn(n)})
    tensors, _ = load_tensors(blob)
    idx = edit(tensors["w:idx"].clone().long()).to(torch.uint8)
    with pytest.raises(BadRequest, match="indices must ascend strictly"):
        codec.decompress(_retamper(blob, {"w:idx": idx}))


@pytest.mark.parametrize("garbage", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}", b"\xff" * 100])
@every_spec
def test_garbage_is_a_bad_request(spec, garbage):
    with pytest.raises(BadRequest):
        get_compressor(spec).decompress(garbage)


# --- settings ---------------------------------------------------------------------------------------------


def test_get_compressor_takes_a_spec_or_a_method_name():
    assert isinstance(get_compressor("int8"), Dense) and get_compressor("int8").name == "int8"
    sparse = get_compressor(topk(0.03, "int4", block_size=512))
    assert isinstance(sparse, TopK) and sparse.params == {
        "density": 0.03,
        "values": "int4",
        "block_size": 512,
    }
    assert get_compressor(CompressionSpec(method="int2", block_size=64)).params == {"block_size": 64}


def test_unknown_compression_is_a_bad_request():
    with pytest.raises(BadRequest, match="unknown compression 'zip'"):
        get_compressor("zip")


# --- bit packing ------------------------------------------------------------------------------------------


def _reference_pack(codes: list[int], bits: int) -> bytes:
    stream = "".join(format(c, f"0{bits}b")[::-1] for c in codes)  # least significant bit first
    stream += "0" * (-len(stream) % 8)
    return bytes(int(stream[i : i + 8][::-1], 2) for i in range(0, len(stream), 8))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), bits=st.integers(1, 16))
def test_bit_packing_matches_the_reference_layout_and_round_trips(data, bits):
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=70))
    packed = pack(torch.tensor(codes, dtype=torch.int32), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(len(codes), bits)
    assert bytes(packed.tolist()) == _reference_pack(codes, bits)
    assert unpack(packed, bits, len(codes)).tolist() == codes


def test_bit_packing_known_bytes():
    assert pack(torch.tensor([1, 2, 3]), 2).tolist() == [0b111001]
    assert pack(torch.tensor([5, 3, 7]), 3).tolist() == [0b11011101, 0b1]
    assert pack(torch.tensor([0xABC]), 12).tolist() == [0xBC, 0x0A]


@pytest.mark.parametrize("bits", [2, 4, 8, 10, 16])
def test_bit_packing_large_streams(bits):
    codes = torch.randint(0, 2**bits, (1_000_003,), dtype=torch.int32)
    assert torch.equal(unpack(pack(codes, bits), bits, codes.numel()).int(), codes)


def test_dense_codecs_pack_sub_byte_codes():
    x = {"w": torch.randn(1024)}
    sizes = {
        m: load_tensors(get_compressor(m).compress(x))[0]["w:codes"].numel() for m in ("int8", "int4", "int2")
    }
    assert sizes == {"int8": 1024, "int4": 512, "int2": 256}
    assert json.loads(load_tensors(get_compressor("int2").compress(x))[1]["shapes"]) == {"w": [1024]}
