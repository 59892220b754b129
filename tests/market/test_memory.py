"""The market's VRAM estimate: asked of GPU nodes when resources.min_vram_gb is unset, never of CPU nodes."""

import pytest

from gpuflex.market.matching import NodeOffer, Requirements, unmet
from gpuflex.market.memory import vram_estimate_gb
from gpuflex.protocol.spec import parse_job_spec


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
