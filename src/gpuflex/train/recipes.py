"""Recipes: a recipe name in the job spec -> a builder of its model, seeded from the spec.

Seeding makes the aggregator's initial model (round 0) a function of the spec alone, so a
replacement aggregator, or a re-run of the job, starts from the same weights. Builders run
under a lock inside a forked RNG: the seed neither leaks into nor races with other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.model import CharGPT

Builder = Callable[[TrainingSpec], nn.Module]

RECIPES: dict[str, Builder] = {
    "char-gpt": lambda spec: CharGPT(spec.model),
}

_SEED_LOCK = threading.Lock()


def get_recipe(name: str) -> Builder:
    """The builder registered as ``name``; BadRequest if there is none."""
    try:
        return RECIPES[name]
    except KeyError:
        raise BadRequest(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}") from None


def build_model(spec: TrainingSpec) -> nn.Module:
    """The spec's recipe's model, initialised from ``spec.seed``."""
    builder = get_recipe(spec.recipe)
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return builder(spec)
