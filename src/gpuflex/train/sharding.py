"""A replica sharded over a node's devices with PyTorch's FSDP2 (``training.shard``): for a model bigger
than one device.

Each rank holds a shard of every weight (dim 0, ``fully_shard``'s ``Shard(0)``), of its gradient and of
its optimizer state; ``fully_shard`` wraps each transformer block, then the root (the embeddings, the
head and the final norm), as torchtitan does, so a block's weights are gathered whole only while it runs
(the root's for the whole step). The weights are gathered in the dtype they are held in (fp32 trained
weights, a LoRA base in the steps' dtype) and ``training.precision`` autocasts from them, as on one device:
no ``MixedPrecisionPolicy``, so a sharded round is the unsharded one up to float reassociation. The
reduce-scatter averages the ranks' gradients; ``clip_grad_norm_`` takes the norm over the whole model
(the shards' norms reduced across ranks); AdamW steps each shard.

The round's start reaches each rank as its own rows (``load``: rank 0 scatters them), so rank 0 sends
each byte of the model once rather than once per rank, and no follower ever holds a whole tensor. A
trace boundary's state reaches rank 0 one tensor at a time (``full_tensors``: ``DTensor.full_tensor``,
an all-gather every rank takes part in), so no rank holds more than its shards, one whole tensor and,
on rank 0, the host copies it keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gpuflex.train.device_group import DeviceGroup, Params


class Sharded(DeviceGroup):
    kind = "fsdp"

    def place(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place, block by block and then the root; each block's shards move to this
        rank's device as it is sharded, so the whole model never sits on one device."""
        mesh = init_device_mesh(self.device.type, (self.size,))
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def load(self, params: dict[str, nn.Parameter], start: Params) -> None:
        with torch.no_grad():
            for name, p in params.items():
                local = p.to_local()  # without autograd: the shard's own storage
                rows = -(-p.shape[0] // self.size)  # FSDP2 cuts dim 0 as torch.chunk does
                piece = local.new_empty((rows, *p.shape[1:]))
                dist.scatter(piece, self._slices(start[name], rows) if self.rank == 0 else None, src=0)
                local.copy_(piece[: len(local)])  # the last ranks' shards may be shorter, or empty

    def _slices(self, whole: Tensor, rows: int) -> list[Tensor]:
        """Rank 0: ``whole`` cut into every rank's rows, padded to ``rows`` each (a scatter's pieces are
        all one size)."""
        padded = whole.new_zeros((rows * self.size, *whole.shape[1:]), device=self.device)
        padded[: len(whole)] = whole
        return list(padded.split(rows))

    def full_tensors(self, state: Params) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in state.items():
            whole = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.rank == 0:
                yield name, whole


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the members of its outermost ``nn.ModuleList``s (char-gpt's
    ``transformer.h``; a transformers model's ``layers`` or ``h``, under peft's wrappers too)."""
    found: list[nn.Module] = []
    lists: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(f"{outer}.") for outer in lists):
            lists.append(name)
            found.extend(module)
    return found
