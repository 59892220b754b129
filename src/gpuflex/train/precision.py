"""How one inner step computes: autocast dtype, fp16's loss scale, and micro-batches.

``training.precision`` picks the autocast dtype (weights, gradients and AdamW moments stay fp32, so the
trace hashes the same kind of state whatever the precision). bf16 autocasts on CUDA and on CPU. fp16
autocasts on CUDA only, with a ``torch.amp.GradScaler`` at a fixed scale (``FP16_LOSS_SCALE``) made fresh
for every step: a step whose gradients overflow is skipped, and no scale carries from step to step,
since a dynamic scale would be state an auditor re-running one trace segment would have to restore. On a
CPU, fp16 falls back to fp32 (the worker logs it): its CPU kernels are few and slow. The precision a
step ran in is part of the hardware class a commitment names (``commitment.device_class``), so an audit
re-runs in the same one.

``training.micro_batch_size`` splits each batch into micro-batches whose gradients add up to the
batch's (gradient accumulation, each micro-batch's loss weighed by its share), for a batch that does not
fit in memory at once. Without it a step is exactly what it was before precision existed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpuflex.protocol.spec import TrainingSpec

FP16_LOSS_SCALE = 2.0**12  # fixed: gradients of fp16 activations lift off underflow, rarely overflow
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

Batch = tuple[Tensor, ...]


def effective(precision: str, device: torch.device) -> str:
    """The precision a device really runs ``precision`` in: fp16 needs CUDA, else fp32."""
    return "fp32" if precision == "fp16" and device.type != "cuda" else precision


@dataclass(frozen=True)
class InnerStep:
    """The numerics of an inner step on one device: its autocast dtype (None: fp32) and micro-batch size."""

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    micro_batch_size: int | None = None

    @classmethod
    def for_spec(cls, spec: TrainingSpec, device: torch.device) -> InnerStep:
        return cls(device.type, DTYPES[effective(spec.precision, device)], spec.micro_batch_size)

    @property
    def label(self) -> str:
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler for one step (None: no scaling)."""
        if self.dtype != torch.float16:
            return None
        return torch.amp.GradScaler(self.device_type, init_scale=FP16_LOSS_SCALE)

    def autocast(self) -> AbstractContextManager:
        return nullcontext() if self.dtype is None else torch.autocast(self.device_type, self.dtype)

    def backward(
        self,
        loss_fn: Callable[[nn.Module, Batch], Tensor],
        model: nn.Module,
        batch: Batch,
        scaler: torch.amp.GradScaler | None,
    ) -> float:
        """Accumulate the gradient of ``batch``'s mean loss; returns that loss."""
        size = len(batch[0])
        micro = self.micro_batch_size or size
        total = 0.0
        for start in range(0, size, micro):
            part = tuple(t[start : start + micro] for t in batch)
            with self.autocast():
                loss = loss_fn(model, part)
            if micro < size:
                loss = loss * (len(part[0]) / size)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.item()
        return total
