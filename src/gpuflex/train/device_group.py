"""A replica spanning the provider's own devices: its ranks, their processes and their rounds.

The task process is rank 0, the only one that talks to the network; it starts ranks 1..N-1 as
child processes on this machine (NCCL across GPUs, gloo on CPU). Every round rank 0 tells the others
the round's label and hands every rank the round's start weights (``load``); all ranks then take the
same inner steps in lockstep, each sampling its own batches, with gradients averaged across them, so
the replica's pseudo-gradient covers every rank's tokens. Rank 0 commits for the replica: a boundary's
state reaches it whole through ``full_tensors``, which every rank takes part in::

    leader:    group.begin_round(label) -> train -> Δ -> exchange      (repeat) -> group.close()
    follower:  while (label := group.next_round()) is not None: train  (its Δ is empty)

How the ranks split the model is the subclass's: ``DataParallel`` here (DDP: a whole copy on each
rank, gradients all-reduced), ``sharding.Sharded`` (FSDP2: each rank holds a shard of the weights,
gradients and optimizer state; ``training.shard``).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gpuflex.protocol.messages import TaskConfig

Params = dict[str, Tensor]
# a follower rank's work: (its group, the task's config, the blobs rank 0 fetched, the model directory)
Follower = Callable[["DeviceGroup", TaskConfig, dict[str, bytes], Path | None], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DeviceGroup(ABC):
    size: int
    rank: int
    device: torch.device
    followers: list[mp.Process]

    kind: ClassVar[str]  # how the ranks split the work, in the replica's hardware class: ``cpu/2t/ddp2``

    @classmethod
    def start(
        cls, config: TaskConfig, blobs: dict[str, bytes], model_dir: Path | None, follower: Follower
    ) -> DeviceGroup:
        """Start ranks 1..N-1 running ``follower(group, config, blobs, model_dir)`` and join them as rank 0.
        ``model_dir``: the job's model directory rank 0 wrote out, which outlives the group."""
        size, port = config.training.local_devices, _free_port()
        context = mp.get_context("spawn")
        followers = [
            context.Process(
                target=_run_follower,
                args=(cls, rank, size, port, config, blobs, model_dir, follower),
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in followers:
            process.start()
        return cls._join(0, size, port, followers)

    @classmethod
    def _join(cls, rank: int, size: int, port: int, followers: list[mp.Process]) -> DeviceGroup:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= size
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        return cls(size, rank, device, followers)

    @abstractmethod
    def place(self, model: nn.Module) -> nn.Module:
        """Lay ``model`` (built whole, in host memory) out on this rank; returns the module forward and
        backward go through, which averages gradients across the ranks."""

    @abstractmethod
    def load(self, params: dict[str, nn.Parameter], start: Params) -> None:
        """Every rank: put the round's start weights (``start``: rank 0's, whole; {} on the others) into
        ``params``, this rank's trained parameters."""

    @abstractmethod
    def full_tensors(self, state: Params) -> Iterable[tuple[str, Tensor]]:
        """Every rank: each of ``state``'s tensors whole, one at a time, on rank 0; nothing on the others.
        Consume it to the end on every rank: a sharded tensor is gathered by all of them."""

    def begin_round(self, label: int) -> None:
        """Rank 0: start the round ``label`` on every rank."""
        self._header(go=1, label=label)

    def next_round(self) -> int | None:
        """Ranks 1..N-1: the next round's label, or None when the task ends."""
        header = self._header()
        return int(header[1]) if header[0] else None

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


class DataParallel(DeviceGroup):
    """DDP: every rank holds the whole model, gradients and optimizer state; gradients are all-reduced."""

    kind = "ddp"

    def place(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model.to(self.device), device_ids=ids)

    def load(self, params: dict[str, nn.Parameter], start: Params) -> None:
        with torch.no_grad():
            for name, p in params.items():
                if self.rank == 0:
                    p.copy_(start[name])
                dist.broadcast(p.data, src=0)

    def full_tensors(self, state: Params) -> Iterable[tuple[str, Tensor]]:
        return state.items() if self.rank == 0 else ()  # rank 0 holds it all


def _run_follower(
    cls: type[DeviceGroup],
    rank: int,
    size: int,
    port: int,
    config: TaskConfig,
    blobs: dict[str, bytes],
    model_dir: Path | None,
    follower: Follower,
) -> None:
    torch.set_num_threads(1)
    group = cls._join(rank, size, port, [])
    try:
        follower(group, config, blobs, model_dir)
    finally:
        dist.destroy_process_group()
