"""Next-token cross-entropy without the whole batch's logits: the output head and the loss, a chunk at a time.

A language model's logits are tokens × vocabulary: for a 128k vocabulary and a micro-batch of 4,096 tokens
that is 2 GB in bf16, and the loss's fp32 copy, softmax and gradient triple it, more than the rest of a
LoRA step on an 8B model. ``chunked_cross_entropy`` computes the head and the loss ``LOSS_CHUNK`` tokens at
a time and, as Liger-Kernel's fused linear cross-entropy does, the gradients of the hidden states and of
the head's weight in the same pass, so no chunk's logits outlive it and the backward recomputes nothing.
The matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would under it) and the
softmax in fp32; the loss is the mean over all tokens, as ``F.cross_entropy``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpuflex.market.memory import LOSS_CHUNK


def chunked_cross_entropy(
    hidden: Tensor, head: nn.Linear, targets: Tensor, chunk: int = LOSS_CHUNK
) -> Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets`` (hidden: [..., width], targets: [...])."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        return _Fused.apply(
            hidden.reshape(-1, hidden.size(-1)), head.weight, head.bias, targets.reshape(-1), chunk, dtype
        )


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, dtype):
        compute = dtype or weight.dtype
        w = weight.to(compute)
        b = None if bias is None else bias.to(compute)
        count = targets.numel()
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
        )
        for start in range(0, count, chunk):
            h = hidden[start : start + chunk].to(compute)
            t = targets[start : start + chunk]
            logits = (h @ w.T if b is None else torch.addmm(b, h, w.T)).float()
            log_z = torch.logsumexp(logits, dim=-1)
            target = t[:, None]
            picked = logits.gather(1, target)
            loss += (log_z - picked.squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            # d(loss)/d(logits) = (softmax - one-hot) / count, in the logits' own memory; one target a row, so
            # a scatter (not an indexed write, which deterministic mode serializes) takes the one off
            grad = logits.sub_(log_z[:, None]).exp_()
            grad.scatter_(1, target, torch.exp(picked - log_z[:, None]) - 1)
            grad = grad.div_(count).to(compute)
            del logits
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = (grad @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad.T @ h).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden, grad_weight, grad_bias), (weight_dtype, bias_dtype) = ctx.grads, ctx.dtypes
        ctx.grads = None
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * grad_loss).to(weight_dtype),
            None if grad_bias is None else (grad_bias * grad_loss).to(bias_dtype),
            None,
            None,
            None,
        )
