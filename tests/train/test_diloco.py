"""``DiLoCo`` around a training loop of one's own, and the runnable example that shows it."""

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from gpuflex.protocol.messages import ContributionReceipt, ContributionSubmit
from gpuflex.train import DiLoCo, LocalTransport, inner_optimizer
from gpuflex.train.model import CharGPT

from .helpers import Publisher, tiny_spec

EXAMPLE = Path(__file__).parents[2] / "examples" / "own_training_loop.py"


def test_the_example_job_trains():
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main()
    assert len(losses) == example.SPEC.rounds + 1
    assert losses[-1] < 0.5 * losses[0]


class _Recording(LocalTransport):
    submitted: list[ContributionSubmit]

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        self.submitted.append(c)
        return super().submit_contribution(c)


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_it_joins_at_the_global_weights_and_exchanges_every_inner_steps(optimizer):
    spec = tiny_spec(rounds=2, inner_steps=3, inner_optimizer="muon" if optimizer == "muon" else "adamw")
    transport = _Recording(2, live_workers=1)
    transport.submitted = []
    publisher = Publisher(transport, spec)
    model = CharGPT(spec.model)  # the recipe's architecture, other weights (no seed)
    inner = (
        torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else inner_optimizer(model, spec)
    )
    opt = DiLoCo(
        model,
        inner,
        transport=transport,
        spec=spec,
        poll_interval_s=0.001,
    )
    joined = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(joined[n], p) for n, p in publisher.replica.parameters().items())

    def aggregator() -> None:
        for _ in range(2):
            while len(transport.submitted) <= publisher.replica.round:
                threading.Event().wait(0.001)
            publisher.next_round()

    thread = threading.Thread(target=aggregator)
    thread.start()
    steps = 0
    while not opt.finished:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step(loss=1.5)
        opt.zero_grad()
        steps += 1
    thread.join()
    assert steps == 6 and [c.round for c in transport.submitted] == [0, 1]
    assert all(c.steps == 3 and c.train_loss == 1.5 for c in transport.submitted)
    if optimizer == "muon":  # the hidden matrices stepped with Muon, the rest with AdamW
        kept = {n: set(inner.state[p]) for n, p in model.named_parameters()}
        assert kept["transformer.h.0.mlp.c_fc.weight"] == {"momentum_buffer"}
        assert kept["transformer.wte.weight"] == {"step", "exp_avg", "exp_avg_sq"}
