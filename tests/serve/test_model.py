"""What a replica holds: the weights, and the KV cache that follows them, in the dtype served — a 16-bit
checkpoint's own, an fp32 one's in bf16, fp32 only where asked — and nothing downloaded."""

from __future__ import annotations

import logging

import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.serve.engine import Engine
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams
from gpuflex.testing import save_llama


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, corpus_lines):
    return save_llama(tmp_path_factory.mktemp("bf16") / "m", ["\n".join(corpus_lines)], dtype="bfloat16")


def cache_dtypes(served: ServedModel) -> set[torch.dtype]:
    """The dtypes of the KV caches the engine hands the model while it decodes a few tokens."""
    seen: set[torch.dtype] = set()

    def look(_module, _args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # its name differs across releases
        seen.update(layer.keys.dtype for layer in cache.layers if layer.keys is not None)

    hook = served.model.register_forward_pre_hook(look, with_kwargs=True)
    try:
        with Engine(served) as engine:
            engine.submit(served.encode("alpha beta"), SamplingParams(temperature=0, max_tokens=4)).result(60)
    finally:
        hook.remove()
    return seen


def test_a_bf16_checkpoint_is_served_in_bf16_weights_and_cache(bf16_dir):
    served = ServedModel.load(bf16_dir, device="cpu")
    assert served.dtype == "bf16" and served.model.dtype == torch.bfloat16
    assert {p.dtype for p in served.model.parameters()} == {torch.bfloat16}
    assert cache_dtypes(served) == {torch.bfloat16}  # filled by the prefill, read by each decode step


def test_an_fp32_checkpoint_is_served_in_bf16_and_in_fp32_where_asked(model_dir):
    assert ServedModel.load(model_dir, device="cpu").model.dtype == torch.bfloat16
    served = ServedModel.load(model_dir, device="cpu", dtype="fp32")
    assert served.dtype == "fp32" and served.model.dtype == torch.float32
    assert cache_dtypes(served) == {torch.float32}


def test_fp16_on_a_cpu_is_served_in_fp32_and_says_so(bf16_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="gpuflex.serve.model"):
        served = ServedModel.load(bf16_dir, device="cpu", dtype="fp16")
    assert served.dtype == "fp32" and served.model.dtype == torch.float32
    assert "fp16 needs CUDA" in caplog.text


def test_a_dtype_that_is_none_of_them_is_refused(bf16_dir):
    with pytest.raises(BadRequest, match="give auto, bf16, fp16 or fp32"):
        ServedModel.load(bf16_dir, device="cpu", dtype="int8")
