"""Wrap your own PyTorch training loop in DiLoCo: two workers and an aggregator on one machine.

    python examples/own_training_loop.py

Each worker's loop is ordinary PyTorch; only the optimizer is wrapped. Here the workers and the
aggregator share an in-memory ``LocalTransport`` in threads; on the network, a task gets a
``TaskClient`` (``gpuflex.client``) instead and the same code runs unchanged.
"""

import threading

import torch
import torch.nn.functional as F
from torch import nn

from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train import DiLoCo, LocalTransport, Recipe, TaskData, aggregate

SPEC = TrainingSpec(rounds=6, inner_steps=25, compression="int8", outer_momentum=0.9)
WORKERS = 2
BATCH = 64


def make_model(spec: TrainingSpec) -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def make_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(BATCH, 2, generator=generator) * 4 - 2
    return x, torch.sin(x[:, :1] * 2) * torch.cos(x[:, 1:])


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def worker(transport, index: int) -> None:
    model = make_model(SPEC)
    opt = DiLoCo(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        transport=transport,
        spec=SPEC,
        tokens_per_step=BATCH,
    )
    generator = torch.Generator().manual_seed(index)
    while not opt.finished:  # your loop: only the optimizer is wrapped
        loss = loss_fn(model, make_batch(generator))
        loss.backward()
        opt.step(loss.item())
        opt.zero_grad()


def main() -> list[float]:
    """Run the job; returns the validation loss of every published round."""
    validation = [make_batch(torch.Generator().manual_seed(1234))]
    recipe = Recipe(
        "own-loop",
        build_model=make_model,
        loss=loss_fn,
        needs_dataset=False,
        build_data=lambda *_: TaskData(sample=make_batch, validation=validation, tokens_per_batch=BATCH),
    )
    transport = LocalTransport(SPEC.rounds, live_workers=WORKERS)
    threads = [threading.Thread(target=worker, args=(transport.for_task(f"w{i}"), i)) for i in range(WORKERS)]
    for thread in threads:
        thread.start()
    summary = aggregate(SPEC, transport, recipe, validation, poll_interval_s=0.01)
    for thread in threads:
        thread.join()
    losses = [summary.val_losses[r] for r in sorted(summary.val_losses)]
    for r, loss in enumerate(losses):
        print(f"round {r}: validation loss {loss:.4f}")
    return losses


if __name__ == "__main__":
    main()
