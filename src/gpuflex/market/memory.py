"""GPU memory a worker of a job, or a replica of a deployment, needs: the market's estimate when
``resources.min_vram_gb`` is not set.

Rough, and meant to err high: a worker holds its model twice (the copy it trains and its replica of the
global model, both fp32), and for the parameters it trains their gradients, AdamW's two moments (Muon
keeps one for the matrices it steps, so there it errs higher), the outer momentum and the
error-feedback residual (fp32 each), plus a copy of parameters and moments at each trace segment
boundary (``commitment.Tracer``: 9 by default); then activations, about 34 bytes per token
per layer per unit of width in 16-bit autocast (Korthikanti et al. 2022, with attention's quadratic term
left out as fused kernels do), twice that in fp32, and 2 bytes per token per layer per unit of width with
gradient checkpointing (only the layers' inputs are kept); the whole batch's at once unless
``micro_batch_size`` splits it. A margin covers the allocator, the CUDA context and the logits.

The estimate applies to GPU nodes only, the nodes whose offer lists VRAM: a CPU node trains in its RAM,
which offers do not list, so a CPU node (0 GB of VRAM) still takes a job's worker, as the tiny test models
need.
"""

from __future__ import annotations

import math

from gpuflex.market.pricing import parameter_count, trained_count
from gpuflex.protocol.spec import ModelSize, TrainingSpec

GIB = 2**30
TRACE_COPIES = 9  # segment boundaries the tracer keeps: commitment.SEGMENTS + 1
PER_TRAINED = 4 * (4 + TRACE_COPIES * 3)  # bytes: grad, 2 moments, outer momentum, residual; trace copies
ACTIVATION_BYTES = {"fp32": 68, "bf16": 34, "fp16": 34}  # per token, layer and unit of width
CHECKPOINTED_BYTES = 2
MARGIN = 1.2
OVERHEAD_GB = 0.5


def vram_estimate_gb(training: TrainingSpec) -> float | None:
    """GiB of GPU memory one worker needs, rounded up to a tenth; None when the model's size is unknown."""
    params, trained = parameter_count(training), trained_count(training)
    if params is None or trained is None:
        return None
    layers, width = _shape(training)
    tokens = (training.micro_batch_size or training.batch_size) * training.model.block_size
    per = CHECKPOINTED_BYTES if training.gradient_checkpointing else ACTIVATION_BYTES[training.precision]
    total = 2 * 4 * params + PER_TRAINED * trained + tokens * layers * width * per
    return math.ceil((total * MARGIN / GIB + OVERHEAD_GB) * 10) / 10


PREFILL_BYTES = 32  # per token and unit of width: one layer's working set in a 16-bit prefill


def serve_vram_estimate_gb(size: ModelSize, context: int, max_batch: int, dtype: str = "auto") -> float:
    """GiB of GPU memory one replica of a deployment needs, rounded up to a tenth. Its weights in the dtype
    it serves (``serve.model.serving_dtype``: 2 bytes a value but where fp32 is asked; auto serves a 16-bit
    dtype on a GPU); a KV cache as full as its limits allow, in that dtype (keys and values of every layer
    for ``max_batch`` requests of ``context`` tokens, ``kv_width`` wide: grouped-query attention's fewer
    heads, the full width where unknown); and one step's activations: the logits of ``max_batch`` rows in
    fp32 and the prefill of a whole context (``PREFILL_BYTES``: the MLP's gate, up and product at ~3.5x
    the width, the residual stream and attention's projections). Left to the margin: the outputs of every
    layer a prefill keeps for the fingerprints (2 bytes per layer, token and unit of width; 1 GiB for an 8B
    model at 4,096 tokens). Not counted: several long prompts joining at once, prefilled together."""
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
