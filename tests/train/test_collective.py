"""DiLoCo inside a trusted group: ranks of a real gloo process group exchange directly, no aggregator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuflex.errors import ServiceError
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train import DiLoCo
from gpuflex.train.collective import CollectiveTransport
from gpuflex.train.throttle import Link

from .helpers import synthetic_corpus, tiny_spec

WORLD = 2


def _rank(rank: int, tmp: str, spec: TrainingSpec) -> None:
    from gpuflex.train.data import round_generator
    from gpuflex.train.recipes import build_model, evaluate, get_recipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        recipe = get_recipe(spec.recipe)
        data = recipe.build_data(synthetic_corpus(), spec, rank, WORLD)
        model = build_model(spec, recipe)
        with torch.no_grad():  # the ranks start from different weights: joining makes them rank 0's
            for p in model.parameters():
                p.add_(rank * 0.1)
        transport = CollectiveTransport(spec, link=Link(latency_s=0.001))
        opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=spec.lr), transport=transport, spec=spec)
        before = evaluate(recipe, model, data.validation)
        generator = round_generator(spec.seed, rank, 0)
        steps = 0
        while not opt.finished:
            loss = recipe.loss(model, data.sample(generator))
            loss.backward()
            opt.step(loss.item())
            opt.zero_grad()
            steps += 1
        opt.replica.write_to(model)  # the global weights, which the replica holds in host memory
        result = {
            "steps": steps,
            "hash": opt.replica.state_hash(),
            "round": opt.replica.round,
            "before": before,
            "after": evaluate(recipe, model, data.validation),
            "sent": transport.meter.stats.bytes_up,
            "received": transport.meter.stats.bytes_down,
            "waited": transport.meter.stats.wait_s,
        }
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_ranks_train_one_model_and_stay_equal_bit_for_bit(tmp_path):
    spec = tiny_spec(rounds=3, inner_steps=10, compression="int8")
    mp.start_processes(_rank, args=(str(tmp_path), spec), nprocs=WORLD, join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["hash"] == ranks[1]["hash"]  # and each round's hashes were compared in the run
    assert all(r["steps"] == spec.rounds * spec.inner_steps and r["round"] == spec.rounds for r in ranks)
    assert ranks[0]["after"] < ranks[0]["before"] - 0.3
    # rank 0 sent the joining state to rank 1; then each sent its int8 blobs: far fewer bytes than fp32
    assert ranks[0]["sent"] > ranks[1]["sent"] and ranks[1]["received"] > ranks[0]["received"]
    params = sum(p.numel() for p in _model(spec).parameters())
    assert ranks[1]["sent"] < spec.rounds * params * 4 / 3
    assert all(r["waited"] >= 0.001 * (2 + 2 * spec.rounds) for r in ranks)  # every collective paid latency


def _model(spec: TrainingSpec) -> torch.nn.Module:
    from gpuflex.train.recipes import build_model, get_recipe

    return build_model(spec, get_recipe(spec.recipe))


def test_it_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ServiceError, match="init_process_group"):
        CollectiveTransport(tiny_spec())
