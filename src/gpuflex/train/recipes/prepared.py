"""Task data from a prepared dataset (``data.prepared``, or an owner's private one under ``data.federated``):
token windows for char-gpt and hf-causal-lm.

The job's ``dataset`` blob is the manifest. Worker i trains on ``data.assign``'s part of the train
shards for i of n, opened through the task's ``ShardReader`` only when its first batch is drawn, so an
aggregator (which evaluates on the validation split) and an auditor (which draws the batches of the
worker it audits) open nothing else. Batches come from the generator the caller seeds
(``train.data.round_generator(seed, worker, round)``), exactly as on a byte corpus.

A federated job's worker reads its owner's dataset from the directory the agent confined it to
(``LocalShards``): the manifest there must hash to the one its owner announced (``config.dataset``), and
the worker trains on all of it. Its aggregator gets no data: it holds none, so it evaluates nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gpuflex.data.assign import Windows, assign, check_fits, validation_batches
from gpuflex.data.fetch import FetchedShards, LocalShards, ShardReader
from gpuflex.data.fit import check_tokenizer
from gpuflex.data.manifest import Manifest, parse_manifest, read_manifest
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
        shards = reader.open_all([manifest.train[s.shard] for s in spans], manifest.dtype)
        return Windows([tokens[s.start : s.stop] for tokens, s in zip(shards, spans, strict=True)], block)

    validation = reader.open_all(manifest.validation, manifest.dtype)
    return TaskData(
        sample=lambda generator: windows().sample(spec.batch_size, generator),
        validation=validation_batches(validation, spec.eval_batches, spec.batch_size, block),
        tokens_per_batch=spec.batch_size * block,
    )


def federated_data(config: TaskConfig, reader: ShardReader | None) -> TaskData:
    """A federated task's data: a worker's, all of its owner's dataset in ``reader``'s directory; the
    aggregator's, none."""
    spec = config.training
    if config.role == "aggregator":
        return TaskData(sample=_no_batches, validation=[], tokens_per_batch=0)
    if not isinstance(reader, LocalShards):
        raise BadRequest(
            f"this node holds no private dataset {config.federated!r}: a federated worker runs on its owner"
        )
    manifest = read_manifest(reader.directory)
    if manifest.digest != config.dataset:
        raise BadRequest(
            f"the private dataset {config.federated!r} in {reader.directory} changed since its node "
            f"announced it (manifest {manifest.digest}, announced {config.dataset}): restart the provider"
        )
    check_tokenizer(manifest.tokenizer, spec)
    check_fits(
        [s.tokens for s in manifest.train], [s.tokens for s in manifest.validation], 1, spec.model.block_size
    )
    return task_data(manifest, reader, spec, 0, 1)


def _no_batches(_generator: object) -> object:
    raise BadRequest("a federated job's aggregator holds no data to train on")
