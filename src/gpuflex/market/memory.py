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


def serve_vram_estimate_gb(size: ModelSize, context: int, max_batch: int) -> float:
    """GiB of GPU memory one replica of a deployment needs, rounded up to a tenth: its weights (fp32, to
    err high) and a KV cache as full as its limits allow (keys and values of every layer, fp32, for
    ``max_batch`` requests of ``context`` tokens; grouped-query attention's smaller cache errs high)."""
    kv_cache = 2 * 4 * size.layers * size.hidden * context * max_batch
    total = 4 * size.parameters + kv_cache
    return math.ceil((total * MARGIN / GIB + OVERHEAD_GB) * 10) / 10


def _shape(training: TrainingSpec) -> tuple[int, int]:
    size = training.model.size
    if size is not None:
        return size.layers, size.hidden
    return training.model.n_layer, training.model.n_embd
