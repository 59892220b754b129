"""The market's VRAM estimate: asked of GPU nodes when resources.min_vram_gb is unset, never of CPU nodes."""

import pytest

from gpuflex.market.matching import NodeOffer, Requirements, unmet
from gpuflex.market.memory import serve_vram_estimate_gb, vram_estimate_gb
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import ModelSize, parse_job_spec


def job(**resources):
    return parse_job_spec(
        {
            "name": "tune",
            "resources": resources,
            "training": {
                "recipe": "hf-causal-lm",
                "model": {
                    "from": "./m",
                    "size": {
                        "parameters": 1_000_000_000,
                        "trainable": 4_000_000,
                        "layers": 24,
                        "hidden": 2048,
                    },
                    "block_size": 1024,
                },
                "batch_size": 8,
                "precision": "bf16",
                "lora": {"r": 8},
            },
        }
    )


def gpu(vram: float, gpus=("RTX 4090",)) -> NodeOffer:
    return NodeOffer("n1", "box", "community", 0.1, 50.0, vram, tuple(gpus), "eu")


def test_the_estimate_grows_with_size_precision_and_shrinks_with_lora_and_checkpointing():
    lora = job().training
    estimate = vram_estimate_gb(lora)
    # 2 fp32 copies of 1e9 weights, the adapters' state, 8 x 1024 tokens x 24 layers x 2048 x 34 bytes
    assert estimate == pytest.approx(
        ((8e9 + 112 * 4e6 + 8 * 1024 * 24 * 2048 * 34) * 1.2 / 2**30 + 0.5), abs=0.1
    )
    full = lora.model_copy(update={"lora": None, "model": lora.model.model_copy(update={"size": None})})
    assert vram_estimate_gb(lora.model_copy(update={"precision": "fp32"})) > estimate
    assert vram_estimate_gb(lora.model_copy(update={"gradient_checkpointing": True})) < estimate
    assert vram_estimate_gb(lora.model_copy(update={"micro_batch_size": 2})) < estimate
    assert vram_estimate_gb(full) < 1  # the config's default shape: a tiny model
    assert vram_estimate_gb(lora.model_copy(update={"recipe": "user", "model": full.model})) is None


def test_a_gpu_node_with_less_than_the_estimate_is_refused_and_a_cpu_node_is_not():
    spec = job()
    estimate = vram_estimate_gb(spec.training)
    req = Requirements.from_spec(spec)
    assert req.gpu_vram_gb == estimate and req.min_vram_gb == 0
    assert unmet(gpu(24), req) == [f"vram 24 GB < {estimate:g} GB (the job's estimated need)"]
    assert unmet(gpu(80), req) == []
    assert unmet(gpu(0, gpus=()), req) == []  # a CPU node trains in its RAM
    chosen = Requirements.from_spec(job(min_vram_gb=16))
    assert chosen.gpu_vram_gb == 0 and unmet(gpu(24), chosen) == []


# Llama-3-8B as train/pretrained.describe counts it: 32 layers, 4,096 wide, 8 KV heads of 128, saved in bf16
LLAMA_3_8B = ModelSize(
    parameters=8_030_261_248,
    trainable=8_030_261_248,
    layers=32,
    hidden=4096,
    vocab=128_256,
    embeddings=2 * 128_256 * 4096,
    kv_width=8 * 128,
    dtype="bf16",
)


def test_an_8b_llama_served_at_4096_tokens_for_8_requests_fits_a_24_gb_card():
    estimate = serve_vram_estimate_gb(LLAMA_3_8B, context=4096, max_batch=8)
    weights = 2 * 8_030_261_248  # 16.1 GB in bf16
    kv_cache = 2 * 32 * 1024 * 4096 * 8 * 2  # keys and values, 8 KV heads: 4.3 GB in bf16
    activations = 4 * 8 * 128_256 + 32 * 4096 * 4096  # fp32 logits of a decode step, a whole-context prefill
    assert estimate == pytest.approx((weights + kv_cache + activations) * 1.2 / 2**30 + 0.5, abs=0.1)
    assert estimate <= 24


def test_the_serve_estimate_counts_the_dtype_served_and_grouped_query_attentions_cache():
    auto = serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8)
    assert serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8, "bf16") == auto  # auto serves 16 bits on a GPU
    assert serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8, "fp16") == auto
    fp32 = serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8, "fp32")
    assert 1.9 * auto < fp32 < 2 * auto  # weights and cache twice as wide, the activations alike
    fp32_checkpoint = LLAMA_3_8B.model_copy(update={"dtype": "fp32"})  # auto serves it in bf16 too
    assert serve_vram_estimate_gb(fp32_checkpoint, 4096, 8) == auto
    full_width = LLAMA_3_8B.model_copy(update={"kv_width": None})  # unknown: the cache at hidden's width
    assert serve_vram_estimate_gb(full_width, 4096, 8) > auto + 12  # 4x the 4.3 GB cache, with the margin


def test_a_deployments_dtype_reaches_its_replicas_memory_need():
    spec = {"name": "chat", "model": {"from": "./m", "size": LLAMA_3_8B.model_dump()}, "context": 4096}
    auto = Requirements.from_spec(DeploymentSpec.model_validate(spec))
    fp32 = Requirements.from_spec(DeploymentSpec.model_validate({**spec, "dtype": "fp32"}))
    assert auto.gpu_vram_gb == serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8)
    assert fp32.gpu_vram_gb == serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8, "fp32")
    assert unmet(gpu(24), auto) == [] and unmet(gpu(24), fp32) != []
