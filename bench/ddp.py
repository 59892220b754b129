"""The benchmark's baseline: DDP, a gloo all-reduce of the gradients after every step, on a simulated link.

W processes (``torch.multiprocessing.spawn``, one torch thread each) train the same seeded model on
the same shards and batch size as DiLoCo's workers, with the same inner optimizer
(``training.inner_optimizer``) and gradient clipping, wrapped in ``DistributedDataParallel``. A DDP
communication hook (``ThrottledAllReduce`` of ``gpuflex.train.collective``) does each bucket's
all-reduce and models the link there: a ring all-reduce of b bytes makes each worker send
2·(W−1)/W·b bytes and receive as many, at the same time (the link is full duplex), so the hook counts
both and sleeps ``link.delay_s(2·(W−1)/W·b)``: one latency per bucket, which is generous to DDP (a
real ring pays 2·(W−1) hops). The bytes of DDP's initial broadcast of the model are counted as each
worker's join, as DiLoCo's workers count the checkpoint they join from.

Rank 0 evaluates on the shared validation batches every ``eval_every`` steps between two barriers;
that time is taken out of every rank's wall time. Utilization is (wall - time in the hook) / wall.

The ranks train on CUDA when the machine has it, all on the current device, as the workers of
``gpuflex.train.worker`` do (gloo all-reduces CUDA tensors too).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.collective import LinkMeter, ThrottledAllReduce
from gpuflex.train.data import round_generator
from gpuflex.train.optimizers import inner_optimizer
from gpuflex.train.recipes import build_model, evaluate, get_recipe
from gpuflex.train.schedule import set_lr
from gpuflex.train.throttle import Link, LinkStats
from gpuflex.train.worker import GRAD_CLIP


@dataclass
class DdpResult:
    val_loss: float
    bytes_per_worker: float  # sent + received, the join included
    wall_s: float  # the training loop, evaluation excluded
    utilization: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (bytes, seconds, val loss)


def run_ddp(
    spec: TrainingSpec, corpus: bytes, workers: int, steps: int, link: Link, eval_every: int
) -> DdpResult:
    """Train ``steps`` DDP steps on ``workers`` processes over ``link``; rank 0's measurements."""
    with TemporaryDirectory(prefix="gpuflex-ddp-") as tmp:
        args = (workers, spec, corpus, steps, link, eval_every, tmp)
        mp.start_processes(_rank_main, args=args, nprocs=workers, join=True, start_method="spawn")
        return DdpResult(**json.loads((Path(tmp) / "rank0.json").read_text()))


def _rank_main(
    rank: int,
    workers: int,
    spec: TrainingSpec,
    corpus: bytes,
    steps: int,
    link: Link,
    eval_every: int,
    tmp: str,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=workers)
    try:
        result = _train(rank, workers, spec, corpus, steps, link, eval_every)
        if rank == 0:
            (Path(tmp) / "rank0.json").write_text(json.dumps(asdict(result)))
    finally:
        dist.destroy_process_group()


def _train(
    rank: int, workers: int, spec: TrainingSpec, corpus: bytes, steps: int, link: Link, eval_every: int
) -> DdpResult:
    recipe = get_recipe(spec.recipe)
    data = recipe.build_data(corpus, spec, rank, workers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(spec, recipe).to(device)
    join = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    ddp = DistributedDataParallel(model)
    validation = [tuple(t.to(device) for t in batch) for batch in data.validation]
    meter = LinkMeter(link, LinkStats(bytes_down=join))
    ThrottledAllReduce(workers, meter).register(ddp)
    optimizer = inner_optimizer(model, spec)
    generator = round_generator(spec.seed, rank, 0)
    curve: list[tuple[int, float, float]] = []
    dist.barrier()
    began, paused = time.monotonic(), 0.0
    for step in range(1, steps + 1):
        set_lr(optimizer, spec, (step - 1) / steps)
        loss = recipe.loss(ddp, tuple(t.to(device) for t in data.sample(generator)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            pause = time.monotonic()
            dist.barrier()
            val = evaluate(recipe, model, validation) if rank == 0 else None
            dist.barrier()
            paused += time.monotonic() - pause
            if val is not None:
                curve.append((meter.stats.bytes_total, time.monotonic() - began - paused, val))
    wall = time.monotonic() - began - paused
    return DdpResult(
        curve[-1][2] if curve else float("nan"),
        meter.stats.bytes_total,
        wall,
        1 - meter.stats.wait_s / wall,
        curve,
    )
