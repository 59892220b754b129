"""Task data from a prepared dataset (``data.prepared``): token windows for char-gpt and hf-causal-lm.

The job's ``dataset`` blob is the manifest. Worker i trains on ``data.assign``'s part of the train
shards for i of n, opened through the task's ``ShardReader`` only when its first batch is drawn, so an
aggregator (which evaluates on the validation split) and an auditor (which draws the batches of the
worker it audits) open nothing else. Batches come from the generator the caller seeds
(``train.data.round_generator(seed, worker, round)``), exactly as on a byte corpus.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gpuflex.data.assign import Windows, assign, validation_batches
from gpuflex.data.fetch import FetchedShards, ShardReader
from gpuflex.data.manifest import Manifest, parse_manifest
from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import TaskConfig
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.recipes import TaskData


def prepared_data(
    config: TaskConfig, fetch: Callable[[str], bytes], reader: ShardReader | None
) -> Callable[[int], TaskData]:
    """Any worker's data by index, from the manifest blob ``config.dataset`` (``reader`` None: shards are
    fetched with ``fetch`` into memory)."""
    if config.dataset is None:
        raise BadRequest(
            "a job on a prepared dataset names its manifest as its dataset, and this one has none"
        )
    manifest = parse_manifest(fetch(config.dataset), f"the job's manifest {config.dataset}")
    reader = reader or FetchedShards(fetch)
    return lambda worker: task_data(manifest, reader, config.training, worker, config.num_workers)


def task_data(
    manifest: Manifest, reader: ShardReader, spec: TrainingSpec, worker: int, workers: int
) -> TaskData:
    block = spec.model.block_size

    @functools.cache
    def windows() -> Windows:  # on the first batch: only a worker that trains (or is audited) opens its part
        spans = assign([s.tokens for s in manifest.train], worker, workers)
        parts = [reader.open(manifest.train[s.shard], manifest.dtype)[s.start : s.stop] for s in spans]
        return Windows(parts, block)

    validation = [reader.open(s, manifest.dtype) for s in manifest.validation]
    return TaskData(
        sample=lambda generator: windows().sample(spec.batch_size, generator),
        validation=validation_batches(validation, spec.eval_batches, spec.batch_size, block),
        tokens_per_batch=spec.batch_size * block,
    )
