"""A replica spanning the provider's own devices: data-parallel (DDP) inner steps across local ranks.

The task process is rank 0, the only one that talks to the network; it starts ranks 1..N-1 as
child processes on this machine (NCCL across GPUs, gloo on CPU). Every round rank 0 broadcasts
the round's start weights; all ranks then take the same inner steps in lockstep (DDP averages
their gradients, each rank sampling its own batches), so rank 0's model after the round is the
replica's, and its pseudo-gradient covers every rank's tokens::

    leader:    group.begin_round(start, label) -> train -> Δ -> exchange      (repeat) -> group.close()
    follower:  while (start, label) := group.next_round(): train              (its Δ is dropped)
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gpuflex.protocol.messages import TaskConfig

Params = dict[str, Tensor]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DeviceGroup:
    size: int
    rank: int
    device: torch.device
    followers: list[mp.Process]

    @classmethod
    def start(cls, config: TaskConfig, blobs: dict[str, bytes], follower: Callable) -> DeviceGroup:
        """Start ranks 1..N-1 running ``follower(group, config, blobs)`` and join them as rank 0."""
        size, port = config.training.local_devices, _free_port()
        context = mp.get_context("spawn")
        followers = [
            context.Process(
                target=_run_follower, args=(rank, size, port, config, blobs, follower), daemon=True
            )
            for rank in range(1, size)
        ]
        for process in followers:
            process.start()
        return cls._join(0, size, port, followers)

    @classmethod
    def _join(cls, rank: int, size: int, port: int, followers: list[mp.Process]) -> DeviceGroup:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= size
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        return cls(size, rank, device, followers)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train with: gradients are averaged across the ranks at each backward."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def begin_round(self, start: Params, label: int) -> None:
        """Rank 0: send every rank the round's start weights."""
        self._header(go=1, label=label)
        for tensor in start.values():
            dist.broadcast(tensor.to(self.device), src=0)

    def next_round(self, like: Params) -> tuple[Params, int] | None:
        """Ranks 1..N-1: the next round's start weights and label, or None when the task ends."""
        header = self._header()
        if header[0] == 0:
            return None
        start = {}
        for name, tensor in like.items():
            start[name] = torch.empty_like(tensor, device=self.device)
            dist.broadcast(start[name], src=0)
        return start, int(header[1])

    def _header(self, go: int = 0, label: int = 0) -> Tensor:
        header = torch.tensor([go, label], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        return header

    def close(self, *, abort: bool = False) -> None:
        """Rank 0: let the followers finish (or, mid-round, stop them) and leave the group."""
        if not abort:
            self._header(go=0)
        for process in self.followers:
            if abort:
                process.terminate()
            process.join(timeout=30)
        dist.destroy_process_group()


def _run_follower(rank: int, size: int, port: int, config: TaskConfig, blobs: dict[str, bytes], follower):
    torch.set_num_threads(1)
    group = DeviceGroup._join(rank, size, port, [])
    try:
        follower(group, config, blobs)
    finally:
        dist.destroy_process_group()
