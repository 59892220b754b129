"""Where a worker's tensors live and in which dtype: the rules ``market/memory.py`` estimates by, applied.

- The frozen base of a LoRA job is loaded once, in the dtype its steps compute in (``frozen_dtype``: bf16
  or fp16 when they autocast to it on this device, else fp32), or quantized (``training.quantize_base``,
  through transformers' bitsandbytes integration, on the device it trains on: ``load_options``). A full
  fine-tune's weights are all trained: fp32, the master copy autocast reads.
- DiLoCo's outer state (the global replica of the trained parameters, the outer momentum, the residual)
  lives in host memory (``host``: pinned where CUDA is, so copies to and from the device can overlap with
  compute), never on the accelerator: a worker's device holds what a plain training loop of the model
  holds (``bench/memory.py`` measures it).
- The tracer keeps the training state at the round's start in host memory, and further segment boundaries
  only while they fit ``market.memory.SNAPSHOT_BUDGET`` (``snapshot_stride``): an audited segment's start
  is re-derived by re-running the deterministic steps before it (``commitment.RoundTrace``).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.market import memory
from gpuflex.market.memory import base_dtype
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.precision import DTYPES, effective

# bitsandbytes warns on import, on a CPU with AVX512-BF16, that it could not fetch a faster 4-bit kernel from
# a model hub: nothing is fetched at run time here, by design, and its own kernels run instead
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def training_device() -> torch.device:
    """Where this process trains: the first CUDA GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def frozen_dtype(spec: TrainingSpec, device: torch.device) -> torch.dtype:
    """The dtype a job's frozen weights are held in on ``device`` (a full fine-tune's: fp32)."""
    held = base_dtype(spec)
    if held not in DTYPES:  # quantized: what bitsandbytes leaves unquantized is held in the steps' dtype
        held = spec.precision if spec.lora is not None else "fp32"
    return DTYPES[effective(held, device)] or torch.float32


def load_options(spec: TrainingSpec, device: torch.device) -> dict:
    """``from_pretrained``'s options for a job's model directory on ``device``: its dtype, and with
    ``quantize_base`` the bitsandbytes quantization, done as the weights load onto the device."""
    options: dict = {"dtype": frozen_dtype(spec, device)}
    if spec.quantize_base is None:
        return options
    import transformers

    try:
        import bitsandbytes  # noqa: F401  (transformers needs it; say so in our words)
    except ImportError:
        raise BadRequest(
            f"training.quantize_base {spec.quantize_base} needs bitsandbytes on this node: "
            "pip install 'gpuflex[quantized]'"
        ) from None
    compute = DTYPES[effective(spec.precision, device)] or torch.float32
    if spec.quantize_base == "nf4":
        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,  # QLoRA's: the block scales quantized too (4.127 bits a weight)
            bnb_4bit_compute_dtype=compute,
            # packed in bf16 elements, which FSDP2 shards and gathers as any other (Answer.AI's FSDP QLoRA)
            bnb_4bit_quant_storage=torch.bfloat16 if spec.shard else torch.uint8,
        )
    else:
        config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    return {**options, "quantization_config": config, "device_map": {"": device}}


def one_kernel(model: nn.Module) -> nn.Module:
    """Keep a quantized base on the kernels it trains with, whatever ran before. bitsandbytes switches
    kernels for inference (eval mode, no gradient), and the switch outlives the call: on a CPU with
    AVX512-BF16 it repacks a 4-bit weight for a kernel that sums in another order, and an int8 layer's
    inference GEMM leaves its state changed. An aggregator's or a verifier's copy, evaluated once, would
    then re-run training steps differently from the worker's, which never ran one: so 4-bit layers never
    repack, and int8 layers compute as in training, in eval mode too (the same dequantize-and-multiply)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # Linear4bit
            module.support_avx512bf16_for_cpu = False
        if type(module).__name__ == "Linear8bitLt":
            module.register_forward_pre_hook(_as_in_training)
    return model


def _as_in_training(module: nn.Module, _inputs: object) -> None:
    module.training = True


def host(tensor: Tensor, *, non_blocking: bool = False) -> Tensor:
    """A host copy of ``tensor`` in its dtype, in pinned memory where CUDA is there (so copies to and from
    the device are DMA transfers); ``non_blocking``: a copy from the device may still be under way when this
    returns (its stream's order, or an event, says when it is done)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return copy.copy_(tensor.detach(), non_blocking=non_blocking and tensor.device.type == "cuda")


def snapshot_stride(state_bytes: int, segments: int, budget: int | None = None) -> int:
    """Keep every ``stride``-th of a round's ``segments + 1`` boundary states (the start always): all of
    them when they fit ``budget`` (``market.memory.SNAPSHOT_BUDGET``: every boundary of a small model, so no
    re-run on an audit; every k-th of a larger one), none but the start when one alone does not."""
    budget = memory.SNAPSHOT_BUDGET if budget is None else budget
    if (segments + 1) * state_bytes <= budget:
        return 1
    return (
        segments + 1 if budget <= 0 else min(segments + 1, math.ceil((segments + 1) * state_bytes / budget))
    )


def state_bytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
