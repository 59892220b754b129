"""Recipes: what a job trains — a model, its data and its loss — by the name in the job spec.

    char-gpt       a nanoGPT-style byte-level GPT on the job's text (``char_gpt.py``)
    hf-causal-lm   a transformers causal LM built from a config, or loaded from the job's model directory
    mlp-digits     an MLP on scikit-learn's bundled 8x8 digits
    user           a Python file of the consumer's, exposing build_model, build_data and loss

char-gpt and hf-causal-lm also train on a prepared dataset's token shards (``prepared.py``).

A recipe's model is built under ``spec.seed`` inside a forked RNG, so round 0 is a function of
the spec alone (a replacement aggregator or a re-run starts from the same weights) and the seed
neither leaks into nor races with other threads.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import TaskConfig
from gpuflex.protocol.spec import TrainingSpec

if TYPE_CHECKING:
    from gpuflex.data.fetch import ShardReader

Batch = tuple[Tensor, ...]
CPU = torch.device("cpu")


@dataclass(frozen=True)
class TaskData:
    """One task's view of the data: its own training batches and the shared validation set."""

    sample: Callable[[torch.Generator], Batch]  # a training batch of this worker's shard
    validation: list[Batch]  # the same fixed batches for everyone, every round
    tokens_per_batch: int  # what one batch counts for when contributions are weighed


@dataclass(frozen=True)
class Recipe:
    name: str
    build_model: Callable[[TrainingSpec], nn.Module]
    # (dataset blob or None, spec, worker_index, num_workers) -> this task's data
    build_data: Callable[[bytes | None, TrainingSpec, int, int], TaskData]
    loss: Callable[[nn.Module, Batch], Tensor]
    needs_dataset: bool = True  # False: the recipe brings its own data
    # (spec, model directory, device) -> the model loaded from it for that device: the recipes that take
    # ``model.from``
    build_pretrained: Callable[[TrainingSpec, Path, torch.device], nn.Module] | None = None

    def from_directory(self, model_dir: Path, device: torch.device = CPU) -> Recipe:
        """This recipe with its model loaded from ``model_dir`` (the job's ``model.from``), laid out for the
        ``device`` its steps run on (``train.placement``: the frozen base's dtype, its quantization)."""
        if self.build_pretrained is None:
            raise BadRequest(f"recipe {self.name} does not load a model directory")
        load = self.build_pretrained
        return replace(self, build_model=lambda spec: load(spec, model_dir, device))


_SEED_LOCK = threading.Lock()


def _builtin() -> dict[str, Recipe]:
    from gpuflex.train.recipes import char_gpt, hf_causal_lm, mlp_digits

    return {r.name: r for r in (char_gpt.RECIPE, hf_causal_lm.RECIPE, mlp_digits.RECIPE)}


def get_recipe(name: str, code: bytes | None = None) -> Recipe:
    """The built-in recipe ``name``, or the user recipe in ``code`` when ``name`` is ``user``."""
    if name == "user":
        from gpuflex.train.recipes.user import load_user_recipe

        if code is None:
            raise BadRequest("recipe 'user' needs its code (the recipe file)")
        return load_user_recipe(code)
    recipes = _builtin()
    if name not in recipes:
        raise BadRequest(f"unknown recipe {name!r}; known: {', '.join(sorted(recipes))}, user")
    return recipes[name]


def for_task(
    config: TaskConfig,
    fetch: Callable[[str], bytes],
    reader: ShardReader | None = None,
    model_dir: Path | None = None,
    device: torch.device = CPU,
) -> tuple[Recipe, TaskData]:
    """The task's recipe and data; ``fetch`` gets a blob by hash (the recipe code, the dataset),
    ``reader`` a prepared dataset's shards (``recipes.prepared``); ``model_dir``: the job's model
    directory, written out (``train.pretrained``), if it has one, loaded for ``device``."""
    spec = config.training
    recipe = get_recipe(spec.recipe, fetch(config.recipe_code) if config.recipe_code else None)
    if model_dir is not None:
        recipe = recipe.from_directory(model_dir, device)
    if config.federated is not None:
        from gpuflex.train.recipes.prepared import federated_data

        return recipe, federated_data(config, reader)
    if recipe.needs_dataset and config.dataset is None:
        raise BadRequest(f"recipe {spec.recipe} trains on a dataset, and the job has none")
    if config.prepared:
        from gpuflex.train.recipes.prepared import prepared_data

        return recipe, prepared_data(config, fetch, reader)(config.worker_index)
    dataset = fetch(config.dataset) if config.dataset else None
    return recipe, recipe.build_data(dataset, spec, config.worker_index, config.num_workers)


def shards(
    config: TaskConfig, recipe: Recipe, fetch: Callable[[str], bytes], reader: ShardReader | None = None
) -> Callable[[int], TaskData]:
    """Any worker's shard of the task's dataset by worker index, each built once: what an auditor draws
    that worker's batches from."""
    if config.prepared:
        from gpuflex.train.recipes.prepared import prepared_data

        return functools.cache(prepared_data(config, fetch, reader))
    dataset = fetch(config.dataset) if config.dataset else None
    built: dict[int, TaskData] = {}

    def data_for(worker: int) -> TaskData:
        if worker not in built:
            built[worker] = recipe.build_data(dataset, config.training, worker, config.num_workers)
        return built[worker]

    return data_for


def build_model(spec: TrainingSpec, recipe: Recipe | None = None) -> nn.Module:
    """The recipe's model, initialised from ``spec.seed``."""
    recipe = recipe or get_recipe(spec.recipe)
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return recipe.build_model(spec)


def evaluate(recipe: Recipe, model: nn.Module, batches: list[Batch]) -> float | None:
    """Mean loss of ``model`` over ``batches`` (None without validation data)."""
    if not batches:
        return None
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = sum(recipe.loss(model, b).item() for b in batches) / len(batches)
    model.train(was_training)
    return loss
