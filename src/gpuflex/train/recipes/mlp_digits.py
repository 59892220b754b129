"""mlp-digits: an MLP classifying scikit-learn's bundled 8x8 digits (1,797 images, shipped offline).

The recipe brings its own data, so the job needs no dataset: a fixed, seeded 80/20 split; each
worker samples from its own contiguous shard of the training part. ``n_embd`` is the hidden width
and ``n_layer`` the number of hidden layers.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.recipes import Batch, Recipe, TaskData

CLASSES = 10
PIXELS = 64


def _digits() -> tuple[Tensor, Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise BadRequest("recipe mlp-digits needs scikit-learn: pip install 'gpuflex[recipes]'") from None
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images[order], labels[order]


def build(spec: TrainingSpec) -> nn.Module:
    width, layers = spec.model.n_embd, spec.model.n_layer
    dims = [PIXELS] + [width] * layers
    hidden = [m for a, b in itertools.pairwise(dims) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*hidden, nn.Linear(dims[-1], CLASSES))


def data(_dataset: bytes | None, spec: TrainingSpec, worker_index: int, num_workers: int):
    images, labels = _digits()
    n_val = len(labels) // 5
    train_x, train_y = images[n_val:], labels[n_val:]
    size = len(train_y) // num_workers
    shard = slice(worker_index * size, (worker_index + 1) * size)
    x, y = train_x[shard], train_y[shard]

    def sample(generator: torch.Generator) -> Batch:
        pick = torch.randint(len(y), (spec.batch_size,), generator=generator)
        return x[pick], y[pick]

    val = [(images[:n_val][i : i + 256], labels[:n_val][i : i + 256]) for i in range(0, n_val, 256)]
    return TaskData(sample=sample, validation=val, tokens_per_batch=spec.batch_size)


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


RECIPE = Recipe(name="mlp-digits", build_model=build, build_data=data, loss=_loss, needs_dataset=False)
