"""char-gpt: the nanoGPT-style byte-level GPT (``gpuflex.train.model``) on the job's text."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.data import ByteDataset, sample_batch, validation_batches
from gpuflex.train.model import CharGPT
from gpuflex.train.recipes import Batch, Recipe, TaskData


def byte_data(dataset: bytes | None, spec: TrainingSpec, worker_index: int, num_workers: int) -> TaskData:
    """Byte windows of the job's text: this worker's shard, and the shared validation split."""
    if dataset is None:
        raise BadRequest(f"recipe {spec.recipe} trains on the job's dataset, and the job has none")
    block = spec.model.block_size
    data = ByteDataset(dataset, block)
    shard = data.shard(worker_index, num_workers)
    return TaskData(
        sample=lambda generator: sample_batch(shard, spec.batch_size, block, generator),
        validation=validation_batches(data.val, spec.eval_batches, spec.batch_size, block),
        tokens_per_batch=spec.batch_size * block,
    )


def next_byte_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return model(inputs, targets)[1]


RECIPE = Recipe(
    name="char-gpt", build_model=lambda spec: CharGPT(spec.model), build_data=byte_data, loss=_loss
)
