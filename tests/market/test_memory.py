"""The market's VRAM estimate: asked of GPU nodes when resources.min_vram_gb is unset, never of CPU nodes."""

from dataclasses import replace

import pytest

from gpuflex.market.matching import NodeOffer, Requirements, unmet
from gpuflex.market.memory import (
    LOSS_BYTES,
    MARGIN,
    OVERHEAD_GB,
    serve_vram_estimate_gb,
    serve_ways_to_fit,
    vram_estimate_gb,
    ways_to_fit,
    worker_memory,
)
from gpuflex.market.quotes import quote
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import ModelSize, TrainingSpec, parse_job_spec

SIZE_FULL = ModelSize(parameters=1_000_000_000, trainable=1_000_000_000, layers=24, hidden=2048)
# the shapes of Llama-3-8B (its LoRA r 16 on q/k/v/o: 13.6M adapters), Llama-3.2-1B and Llama-2-70B
LLAMA_8B = dict(parameters=8_030_261_248, layers=32, hidden=4096, vocab=128_256, embeddings=1_050_673_152)
LLAMA_1B = dict(parameters=1_235_814_400, layers=16, hidden=2048, vocab=128_256, embeddings=262_668_288)
LLAMA_70B = dict(parameters=68_976_648_192, layers=80, hidden=8192, vocab=32_000, embeddings=524_288_000)
ADAPTERS = {"8B": 13_631_488, "70B": 65_536_000}


def table_job(size: dict, **training) -> TrainingSpec:
    lora = training.get("lora") is not None
    trainable = (ADAPTERS["70B"] if size is LLAMA_70B else ADAPTERS["8B"]) if lora else size["parameters"]
    fields = {
        "recipe": "hf-causal-lm",
        "model": {"from": "./m", "size": {**size, "trainable": trainable}, "block_size": 1024},
        "precision": "bf16",
        "batch_size": 4,
        "gradient_checkpointing": True,
        **training,
    }
    return TrainingSpec.model_validate(fields)


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
    # the bf16 base once; fp32 adapters, their gradients and moments; activations of 8 x 1024 tokens x 24
    # layers x 2048 x 38 bytes; one 1,024-token chunk of the loss over the 256 bytes and the hidden
    # states' gradient; the margin and a CUDA context
    frozen, adapters = 2 * (1e9 - 4e6), 16 * 4e6
    activations, loss = 8 * 1024 * 24 * 2048 * 38, 1024 * 256 * LOSS_BYTES + 8 * 1024 * 2048 * 4
    assert estimate == pytest.approx(
        (frozen + adapters + activations + loss) * MARGIN / 2**30 + OVERHEAD_GB, abs=0.1
    )
    full = lora.model_copy(update={"lora": None, "model": lora.model.model_copy(update={"size": None})})
    assert vram_estimate_gb(lora.model_copy(update={"precision": "fp32"})) > estimate
    assert vram_estimate_gb(lora.model_copy(update={"gradient_checkpointing": True})) < estimate
    assert vram_estimate_gb(lora.model_copy(update={"micro_batch_size": 2})) < estimate
    assert vram_estimate_gb(lora.model_copy(update={"quantize_base": "nf4"})) < estimate - 1.3
    assert vram_estimate_gb(full) < 1  # the config's default shape: a tiny model
    assert vram_estimate_gb(lora.model_copy(update={"recipe": "user", "model": full.model})) is None


def test_outer_state_is_counted_in_host_memory_and_never_on_the_device():
    lora = job().training
    memory = worker_memory(lora)
    # replica, momentum, residuals, delta; the round's start; 8 kept boundaries of 12 bytes (under budget)
    assert memory.host == pytest.approx((4 * 5 + 8) * 4e6 + 8 * 12 * 4e6)
    tuned = lora.model_copy(update={"lora": None})  # every weight trained: the same 1e9 parameters
    tuned = tuned.model_copy(update={"model": tuned.model.model_copy(update={"size": SIZE_FULL})})
    whole = worker_memory(tuned)
    assert whole.trained == whole.gradients == 4e9 and whole.optimizer == 8e9 and whole.frozen == 0
    assert worker_memory(tuned.model_copy(update={"optimizer_states": "8bit"})).optimizer < 2.1e9


def test_the_issues_jobs_fit_the_cards_the_network_has():
    """Llama-3-8B LoRA and QLoRA, a 1.2B full fine-tune (Llama-3.2-1B), micro-batches of 4 x 1,024 with
    checkpointing in bf16; an 8B LoRA sharded over a node's two 16 GB cards; and a 70B QLoRA (Llama-2-70B,
    micro-batches of 1 x 1,024) sharded over two 24 GB cards, which a node of two such cards is offered."""
    lora = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert vram_estimate_gb(table_job(LLAMA_8B, lora=lora)) <= 22
    assert vram_estimate_gb(table_job(LLAMA_8B, lora=lora, quantize_base="nf4")) <= 12
    assert vram_estimate_gb(table_job(LLAMA_1B)) <= 24
    sharded = table_job(LLAMA_8B, lora=lora, local_devices=2, shard=True)
    assert vram_estimate_gb(sharded) <= 16
    assert vram_estimate_gb(sharded.model_copy(update={"shard": False, "local_devices": 1})) > 16
    qlora_70b = table_job(
        LLAMA_70B, lora=lora, quantize_base="nf4", local_devices=2, shard=True, batch_size=1
    )
    assert 2 * vram_estimate_gb(qlora_70b) < 48
    req = Requirements.from_spec(
        parse_job_spec({"name": "70b", "training": qlora_70b.model_dump(by_alias=True)})
    )
    pair = replace(gpu(24, gpus=("RTX 4090", "RTX 4090")), kernels=("nf4", "int8", "adamw8bit"))
    assert unmet(pair, req) == [] and unmet(replace(pair, gpus=("RTX 4090",)), req) != []


def test_what_would_make_a_job_fit_is_found_and_named():
    lora = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    tuned = table_job(LLAMA_8B, lora=lora, gradient_checkpointing=False)
    ways = ways_to_fit(tuned, 24)
    assert ways and ways[0].startswith("gradient_checkpointing: true (≈ ")
    assert ways_to_fit(tuned, 12)[0].startswith("gradient_checkpointing: true and quantize_base: nf4")
    full = table_job(LLAMA_8B)
    assert any("lora" in way for way in ways_to_fit(full, 24))
    assert any("shard: true" in way for way in ways_to_fit(table_job(LLAMA_1B), 16, gpus=2))
    assert ways_to_fit(full, 1) == []


def test_a_sharded_worker_holds_its_share_and_the_weights_it_gathers_whole():
    """FSDP2 (``train/sharding.py``) gathers weights in the dtype they are held in, a full fine-tune's fp32
    whatever the steps autocast to: a block while it runs and the next one prefetched, and the root (the
    embeddings and the head) for the whole step. Autocast's 16-bit copies are of whole weights."""
    whole = worker_memory(table_job(LLAMA_1B))
    sharded = worker_memory(table_job(LLAMA_1B, local_devices=2, shard=True))
    params, embeddings, layers = LLAMA_1B["parameters"], LLAMA_1B["embeddings"], LLAMA_1B["layers"]
    assert sharded.gathered == pytest.approx(2 * 4 * (params - embeddings) / layers + 4 * embeddings)
    assert (sharded.trained, sharded.gradients, sharded.optimizer) == (
        whole.trained / 2,
        whole.gradients / 2,
        whole.optimizer / 2,
    )
    assert sharded.casts == whole.casts and whole.gathered == 0
    assert sharded.loss == whole.loss  # the head gathered with the root, the loss still a chunk at a time


def test_a_gpu_node_with_less_than_the_estimate_is_refused_and_a_cpu_node_is_not():
    spec = job()
    estimate = vram_estimate_gb(spec.training)
    req = Requirements.from_spec(spec)
    assert req.gpu_vram_gb == estimate and req.min_vram_gb == 0
    assert unmet(gpu(16), req) == [f"vram 16 GB < {estimate:g} GB (the job's estimated need)"]
    assert unmet(gpu(24), req) == []
    assert unmet(gpu(0, gpus=()), req) == []  # a CPU node trains in its RAM
    chosen = Requirements.from_spec(job(min_vram_gb=16))
    assert chosen.gpu_vram_gb == 0 and unmet(gpu(24), chosen) == []


def test_a_quantized_or_8bit_job_goes_only_to_nodes_that_run_its_kernels():
    spec = job().model_copy(
        update={
            "training": job().training.model_copy(update={"quantize_base": "nf4", "optimizer_states": "8bit"})
        }
    )
    req = Requirements.from_spec(spec)
    assert req.kernels == ("nf4", "adamw8bit")
    assert unmet(gpu(24), req) == ["runs no nf4, adamw8bit kernels (bitsandbytes on its device)"]
    assert unmet(replace(gpu(24), kernels=("nf4", "int8", "adamw8bit")), req) == []


def test_a_sharded_worker_needs_as_many_gpus_each_holding_its_share():
    lora = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    training = table_job(LLAMA_8B, lora=lora, local_devices=2, shard=True)
    spec = parse_job_spec({"name": "big", "training": training.model_dump(by_alias=True)})
    req = Requirements.from_spec(spec)
    pair = gpu(16, gpus=("RTX 4080", "RTX 4080"))
    assert req.devices == 2 and req.gpu_vram_gb <= 16 and unmet(pair, req) == []
    single = gpu(16)
    assert unmet(single, req) == ["1 GPU < 2 (the job's local_devices)"]
    assert unmet(replace(single, vram_gb=0, gpus=()), req) == []  # a CPU node runs its ranks as processes


def test_a_quote_says_when_no_online_gpu_holds_a_worker_and_what_would():
    big = parse_job_spec({"name": "big", "training": table_job(LLAMA_8B).model_dump(by_alias=True)})
    offers = [
        replace(gpu(24), node_id="a", kind="core"),
        replace(gpu(24), node_id="b"),
        replace(gpu(24), node_id="c"),
    ]
    q = quote(big, offers)
    assert not q.placeable and q.too_big is not None
    assert q.too_big.startswith(f"a worker needs ≈ {q.vram_estimate_gb:g} GB of VRAM on its GPU")
    assert "1 × 24 GB: it would fit with " in q.too_big and "lora" in q.too_big
    assert q.host_estimate_gb > 100  # an 8B full fine-tune's outer state: 28 bytes a parameter in host memory
    small = parse_job_spec({"name": "small", "training": job().training.model_dump(by_alias=True)})
    assert quote(small, offers).too_big is None


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
    assert estimate == pytest.approx(
        (weights + kv_cache + activations) * MARGIN / 2**30 + OVERHEAD_GB, abs=0.1
    )
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


def test_what_would_make_a_replica_fit_is_its_dtype_then_a_shorter_context():
    assert serve_ways_to_fit(LLAMA_3_8B, 4096, 8, "fp32", 24)[0].startswith("--dtype bf16 (≈ ")
    shorter = serve_ways_to_fit(LLAMA_3_8B, 8192, 8, "auto", 24)
    assert shorter == [f"--context 4096 (≈ {serve_vram_estimate_gb(LLAMA_3_8B, 4096, 8):g} GB)"]
    assert serve_ways_to_fit(LLAMA_3_8B, 4096, 8, "auto", 8) == []  # its weights alone are 15 GiB
