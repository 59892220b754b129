"""GPU memory a worker of a job, or a replica of a deployment, needs: the market's estimate when
``resources.min_vram_gb`` is not set, and the rules ``train/placement.py`` lays a worker out by.

Where a worker's state lives (``train/placement.py`` applies the same rules, ``bench/memory.py`` holds the
estimate to measurements):

- **on the accelerator**, what a plain training loop of the model holds: the frozen base of a LoRA job in
  the steps' dtype (bf16/fp16 when they autocast to it, else fp32) or quantized (``quantize_base``: nf4 at
  4.127 bits a weight with double-quantized block scales, int8 at 8 bits and a row scale; the embeddings
  and the output head stay in the steps' dtype, as bitsandbytes leaves them); the trained parameters in
  fp32, their gradients, the inner optimizer's state (AdamW's two fp32 moments, or 2 bytes with
  ``optimizer_states: 8bit``; Muon keeps one moment for its matrices, so there this errs high); the 16-bit
  copies autocast makes of trained weights for the backward (one layer's with checkpointing);
  activations, 38 bytes per token per layer per unit of width in 16-bit autocast (Korthikanti et al.
  2022's 34, attention's quadratic term left out as fused kernels do, raised to what ``bench/memory.py``
  measured of llama blocks, whose MLP is 2.7-4x as wide as the stream), twice that in fp32, and with
  gradient checkpointing the layers' inputs plus one layer's activations recomputed; and the loss, whose
  logits are computed ``LOSS_CHUNK`` tokens at a time (``recipes/hf_causal_lm``), never for the whole
  batch at once. Sharded (``shard``, FSDP2: ``train/sharding.py``) over ``local_devices``, weights,
  gradients and optimizer state are split over the devices; a block's weights are gathered whole while
  it runs (and the next block's prefetched), in the dtype they are held in (fp32 trained weights: the
  steps autocast from them, as unsharded), and the root's (embeddings, head) for the whole step; the
  16-bit copies autocast keeps for the backward are of whole weights, so they are not split; each
  device still runs its own micro-batch.
- **in host memory**, never on the accelerator: DiLoCo's outer state (the global replica of the trained
  parameters, the outer momentum, the error-feedback residual and the one before it, the round's
  pseudo-gradient) and the optimizer state at the round's start, which the tracer keeps to re-derive an
  audited segment (``commitment.py``).

A margin covers the allocator's fragmentation, and a CUDA context (not counted by
``torch.cuda.max_memory_allocated``) is added once. The estimate applies to GPU nodes only, the nodes
whose offer lists VRAM: a CPU node trains in its RAM, which offers do not list, so a CPU node (0 GB of
VRAM) still takes a job's worker, as the tiny test models need.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from gpuflex.market.pricing import VOCAB, parameter_count, trained_count
from gpuflex.protocol.spec import ModelSize, TrainingSpec

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
QUANTIZED_BYTES = {"nf4": 4.127 / 8, "int8": 1.0}  # a quantized weight, its block or row scales included
OPTIMIZER_BYTES = {"fp32": 8.0, "8bit": 2.0 + 8 / 256}  # per trained parameter: two moments (+ block maxima)
ACTIVATION_BYTES = {"fp32": 76, "bf16": 38, "fp16": 38}  # per token, layer and unit of width
LOSS_CHUNK = 512  # tokens whose logits exist at once (``train/lm_loss``: the loss a chunk at a time)
LOSS_BYTES = 10  # per token and vocabulary entry of a chunk: 16-bit logits, their fp32 copy (the softmax's
# gradient in place), the 16-bit gradient, and slack for the matmul's output
SNAPSHOT_BUDGET = 512 * 2**20  # host bytes the tracer may keep beyond the round's start (train/placement)
SEGMENTS = 8  # trace segments a round (train/commitment: every inner_steps / 8 steps)
MARGIN = 1.1
OVERHEAD_GB = 0.5  # a CUDA context


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes a worker holds, by part: each device's share on the accelerator, and the host's."""

    frozen: float  # the frozen base (LoRA), in its dtype or quantized
    trained: float  # the trained parameters, fp32
    gradients: float
    optimizer: float  # the inner optimizer's state
    casts: float  # autocast's 16-bit copies of trained weights kept for the backward
    activations: float
    loss: float  # one chunk of logits, and the hidden states' gradient
    host: float  # outer state and the round's start, in host memory
    gathered: float = 0.0  # sharded: the weights gathered whole for the blocks running and the root
    devices: int = 1  # local devices the model state is sharded over

    @property
    def device_bytes(self) -> float:
        """What one device holds, before the margin."""
        return (
            self.frozen
            + self.trained
            + self.gradients
            + self.optimizer
            + self.casts
            + self.gathered
            + self.activations
            + (self.loss)
        )


def compute_dtype(training: TrainingSpec) -> str:
    """The dtype inner steps compute in on a GPU (``train/precision``: fp16 falls back to fp32 on a CPU)."""
    return training.precision


def base_dtype(training: TrainingSpec) -> str:
    """How a LoRA job's frozen base is held: quantized, or in the steps' dtype (fp32 steps: fp32). A full
    fine-tune's weights are all trained, in fp32."""
    if training.quantize_base is not None:
        return training.quantize_base
    return compute_dtype(training) if training.lora is not None else "fp32"


def worker_memory(training: TrainingSpec) -> WorkerMemory | None:
    """A worker's memory by part; None when the model's size is unknown (a user recipe)."""
    params, trained = parameter_count(training), trained_count(training)
    if params is None or trained is None:
        return None
    layers, width = _shape(training)
    embeddings, vocab = _embeddings(training)
    dtype, base = compute_dtype(training), base_dtype(training)
    frozen = params - trained
    if base in QUANTIZED_BYTES:
        kept = min(embeddings, frozen)  # embeddings and head stay in the steps' dtype
        frozen_bytes = (frozen - kept) * QUANTIZED_BYTES[base] + kept * DTYPE_BYTES[dtype]
    else:
        frozen_bytes = frozen * DTYPE_BYTES[base]
    tokens = (training.micro_batch_size or training.batch_size) * training.model.block_size
    layer_activations = tokens * width * ACTIVATION_BYTES[dtype]
    if training.gradient_checkpointing:
        activations = tokens * layers * width * DTYPE_BYTES[dtype] + layer_activations
    else:
        activations = layers * layer_activations
    casts = 0.0
    if dtype != "fp32" and training.lora is None:  # LoRA's adapters are too small to count
        casts = 2 * trained / (layers if training.gradient_checkpointing else 1)
    loss = min(tokens, LOSS_CHUNK) * vocab * LOSS_BYTES + tokens * width * 4
    optimizer = OPTIMIZER_BYTES[training.optimizer_states]
    shards = training.local_devices if training.shard else 1
    gathered = 0.0
    if shards > 1:  # a quantized base's embeddings and head are in the steps' dtype, a full fine-tune's fp32
        root = embeddings * DTYPE_BYTES[dtype if base in QUANTIZED_BYTES else base]
        gathered = 2 * (frozen_bytes + 4 * trained - root) / layers + root
    return WorkerMemory(
        frozen=frozen_bytes / shards,
        trained=4 * trained / shards,
        gradients=4 * trained / shards,
        optimizer=optimizer * trained / shards,
        casts=casts,
        activations=activations,
        loss=loss,
        # replica, momentum, residual and the one before, delta; the round's start; the kept boundaries
        host=(4 * 5 + optimizer) * trained + min(SNAPSHOT_BUDGET, SEGMENTS * (4 + optimizer) * trained),
        gathered=gathered,
        devices=shards,
    )


def kernels(training: TrainingSpec) -> tuple[str, ...]:
    """The bitsandbytes kernels a worker's device must run: a quantized base's, 8-bit AdamW's."""
    needed = (training.quantize_base,) if training.quantize_base is not None else ()
    return needed + (("adamw8bit",) if training.optimizer_states == "8bit" else ())


def vram_estimate_gb(training: TrainingSpec) -> float | None:
    """GiB of GPU memory each of a worker's devices needs, rounded up to a tenth; None when the model's size
    is unknown. Sharded over ``local_devices``, the node needs that on each of as many GPUs."""
    memory = worker_memory(training)
    if memory is None:
        return None
    return _gib(memory.device_bytes)


def _gib(nbytes: float) -> float:
    return math.ceil((nbytes * MARGIN / GIB + OVERHEAD_GB) * 10) / 10


PREFILL_BYTES = 32  # per token and unit of width: one layer's working set in a 16-bit prefill


def serve_vram_estimate_gb(size: ModelSize, context: int, max_batch: int, dtype: str = "auto") -> float:
    """GiB of GPU memory one replica of a deployment needs, rounded up to a tenth. Its weights in the dtype
    it serves (``serve.model.serving_dtype``: 2 bytes a value but where fp32 is asked; auto serves a 16-bit
    dtype on a GPU); a KV cache as full as its limits allow, in that dtype (keys and values of every layer
    for ``max_batch`` requests of ``context`` tokens, ``kv_width`` wide: grouped-query attention's fewer
    heads, the full width where unknown); and one step's activations: the logits of ``max_batch`` rows in
    fp32 and the prefill of a whole context (``PREFILL_BYTES``: the MLP's gate, up and product at ~3.5x
    the width, the residual stream and attention's projections; the fingerprints read the last layer's
    outputs alone, ``serve.engine._last_hidden``). Not counted: several long prompts joining at once,
    prefilled together."""
    width = 4 if dtype == "fp32" else 2
    kv_cache = 2 * size.layers * (size.kv_width or size.hidden) * context * max_batch * width
    logits = 4 * max_batch * (size.vocab or 0)  # unknown only in sizes counted before vocab was: a few MB
    total = width * size.parameters + kv_cache + logits + PREFILL_BYTES * context * size.hidden
    return math.ceil((total * MARGIN / GIB + OVERHEAD_GB) * 10) / 10


def _shape(training: TrainingSpec) -> tuple[int, int]:
    size = training.model.size
    if size is not None:
        return size.layers, size.hidden
    return training.model.n_layer, training.model.n_embd


def _embeddings(training: TrainingSpec) -> tuple[int, int]:
    """Parameters in the token embeddings and the output head, and the vocabulary: a model directory's
    counts, else the spec's shape (byte-level: llama's untied head, GPT-2's tied one and its positions)."""
    m, size = training.model, training.model.size
    if size is not None:
        vocab = size.vocab or VOCAB
        return (size.embeddings if size.embeddings is not None else 2 * vocab * size.hidden), vocab
    if training.recipe == "hf-causal-lm" and m.architecture == "llama":
        return 2 * VOCAB * m.n_embd, VOCAB
    return (VOCAB + m.block_size) * m.n_embd, VOCAB


def ways_to_fit(training: TrainingSpec, vram_gb: float, gpus: int = 1) -> list[str]:
    """The fewest changes to ``training`` after which a worker fits a node of ``gpus`` GPUs of ``vram_gb``
    each, with the estimate each gives (at most three ways; none when nothing listed is enough)."""
    changes = _changes(training, gpus)
    for size in range(1, len(changes) + 1):
        found = []
        for combo in itertools.combinations(changes, size):
            update = {k: v for _, spec in combo for k, v in _difference(training, spec).items()}
            gb = vram_estimate_gb(training.model_copy(update=update)) or 0.0
            if gb <= vram_gb:
                found.append(f"{' and '.join(label for label, _ in combo)} (≈ {gb:g} GB)")
        if found:
            return found[:3]
    return []


def _changes(training: TrainingSpec, gpus: int) -> list[tuple[str, TrainingSpec]]:
    """What would shrink a worker, least intrusive first, each as the spec it makes."""
    out = []

    def change(label: str, **update: object) -> None:
        out.append((label, TrainingSpec.model_validate({**training.model_dump(by_alias=True), **update})))

    if not training.gradient_checkpointing and training.recipe == "hf-causal-lm":
        change("gradient_checkpointing: true", gradient_checkpointing=True)
    micro = training.micro_batch_size or training.batch_size
    if micro > 1:
        change("micro_batch_size: 1", micro_batch_size=1)
    if training.lora is None and training.inner_optimizer == "adamw" and training.optimizer_states == "fp32":
        change("optimizer_states: 8bit", optimizer_states="8bit")
    size = training.model.size
    if training.lora is None and training.recipe == "hf-causal-lm" and size is not None:
        adapters = size.model_copy(update={"trainable": max(1, size.parameters // 200)})  # ~0.5% at r 16
        model = {**training.model.model_dump(by_alias=True), "size": adapters.model_dump()}
        change("lora (adapters on the attention layers)", lora={"r": 16}, model=model)
    if training.lora is not None and training.quantize_base is None:
        change("quantize_base: nf4 (QLoRA)", quantize_base="nf4")
    if gpus > 1 and not training.shard and training.round_seconds is None:
        change(f"local_devices: {gpus} and shard: true", local_devices=gpus, shard=True)
    return out


def _difference(base: TrainingSpec, changed: TrainingSpec) -> dict:
    return {k: v for k, v in changed if getattr(base, k) != v}


def serve_ways_to_fit(size: ModelSize, context: int, max_batch: int, dtype: str, vram_gb: float) -> list[str]:
    """What of a deployment's ``--dtype`` and ``--context`` makes a replica fit ``vram_gb``, with the
    estimate each gives: 16 bits where fp32 was asked, then the longest context that fits (at most three)."""
    options = [("--dtype bf16", {"dtype": "bf16"})] if dtype == "fp32" else []
    shorter = context // 2
    while shorter >= 256:
        options.append((f"--context {shorter}", {"context": shorter}))
        shorter //= 2
    base = {"size": size, "context": context, "max_batch": max_batch, "dtype": dtype}
    found = []
    for label, change in options:
        gb = serve_vram_estimate_gb(**{**base, **change})
        if gb <= vram_gb:
            found.append(f"{label} (≈ {gb:g} GB)")
            if change.keys() == {"context"}:
                break  # the longest context that fits; shorter ones fit too
    return found[:3]
