"""A complete user recipe: a byte-bigram model (the next byte from this one) on the job's text.

A recipe file defines three functions; GPUFlex uploads it with the job and every task runs it in
its sandbox. Submit it with ``gpuflex submit examples/user-recipe.yaml`` (run from the repo root).
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpuflex.train.recipes import TaskData

PAIRS_PER_ROW = 64  # byte pairs per batch row


def build_model(spec):
    """Any torch.nn.Module; GPUFlex seeds torch with spec.seed before calling this."""
    return nn.Embedding(256, 256)  # row b: the logits of the byte after b


def build_data(dataset, spec, worker_index, num_workers):
    """This worker's training batches and the shared validation batches."""
    data = torch.frombuffer(bytearray(dataset), dtype=torch.uint8).long()
    split = len(data) * 9 // 10
    shard = data[:split].chunk(num_workers)[worker_index]
    val = data[split:]

    def sample(generator):
        at = torch.randint(len(shard) - 1, (spec.batch_size * PAIRS_PER_ROW,), generator=generator)
        return shard[at], shard[at + 1]

    return TaskData(
        sample=sample, validation=[(val[:-1], val[1:])], tokens_per_batch=spec.batch_size * PAIRS_PER_ROW
    )


def loss(model, batch):
    """A scalar tensor to minimise."""
    current, following = batch
    return F.cross_entropy(model(current), following)
