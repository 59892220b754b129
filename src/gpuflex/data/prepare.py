"""``gpuflex data prepare``'s work: sources -> tokenizer -> shards -> manifest, as a pipeline.

Three threads, so that no stage waits for another's I/O: one reads and parses batches of documents,
one encodes them (``encode_batch_fast`` runs on Rust threads with the GIL released), and the caller's
thread writes and hashes the shards and reports progress. Each hand-off is a short bounded queue, so
memory stays a few batches whatever the input's size; an error in any stage is raised in the caller.
Whatever stops the run (bad input, Ctrl-C) removes the shards it wrote; the manifest is written last,
atomically, so an output directory with a manifest is always complete.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from contextlib import closing
from pathlib import Path
from typing import TypeVar

import numpy as np

from gpuflex.data.manifest import MANIFEST, Manifest, SourceEntry, dtype_for, write_manifest
from gpuflex.data.shards import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    ShardWriter,
    split_validation,
    validation_count,
)
from gpuflex.data.sources import Source, TextBatch
from gpuflex.data.tokenizer import Tokenizer
from gpuflex.errors import BadRequest

T = TypeVar("T")
Progress = Callable[[int, int], None]  # bytes read, tokens written: each call adds to the totals
_QUEUE_DEPTH = 4  # batches in flight between two stages


def prepare(
    source: Source,
    tokenizer: Tokenizer,
    out: Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    force: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Tokenize ``source`` into shards and a manifest under ``out``; the manifest written.

    The validation split is the stream's last ``val_tokens`` tokens, or its last ``val_fraction``.
    ``out`` must be empty or absent; ``force`` replaces what an earlier prepare wrote there.
    """
    out, dtype = Path(out), dtype_for(tokenizer.info.vocab_size)
    train = ShardWriter(out, "train", shard_tokens, dtype)
    validation = ShardWriter(out, "validation", shard_tokens, dtype)
    _claim(out, force)
    documents = bytes_read = 0
    try:
        with closing(_ahead(_encoded(source, tokenizer))) as encoded:
            for tokens, batch in encoded:
                train.write(tokens)
                documents += len(batch.documents)
                bytes_read += batch.bytes_read
                if progress:
                    progress(batch.bytes_read, len(tokens))
        train.close()
        count = validation_count(sum(s.tokens for s in train.shards), val_tokens, val_fraction)
        train_shards, validation_shards = split_validation(train, validation, count)
        manifest = Manifest(
            tokenizer=tokenizer.info,
            dtype=dtype,
            shard_tokens=shard_tokens,
            train=train_shards,
            validation=validation_shards,
            documents=documents,
            tokens=sum(s.tokens for s in train_shards + validation_shards),
            bytes_read=bytes_read,
            sources=[SourceEntry(path=f.name, kind=f.kind, bytes=f.size) for f in source.files],
        )
        write_manifest(out, manifest)
    except BaseException:
        train.discard()
        validation.discard()
        raise
    return manifest


def _encoded(source: Source, tokenizer: Tokenizer) -> Generator[tuple[np.ndarray, TextBatch], None, None]:
    with closing(_ahead(source.batches())) as batches:
        for batch in batches:
            yield tokenizer.encode(batch.documents), batch


def _claim(out: Path, force: bool) -> None:
    """Create ``out`` after checking that it is empty (or, with ``force``, emptied of an earlier prepare's
    manifest and shards; other files are left alone)."""
    if out.exists() and not out.is_dir():
        raise BadRequest(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        if not force:
            raise BadRequest(
                f"{out} is not empty: choose another directory, or give --force to replace a prepared "
                "dataset there"
            )
        (out / MANIFEST).unlink(missing_ok=True)  # first: never a manifest beside shards it does not name
        for stale in [*out.glob("train-*.bin"), *out.glob("validation-*.bin")]:
            stale.unlink()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


def _ahead(items: Generator[T, None, None]) -> Generator[T, None, None]:
    """``items``, produced by a thread of its own a few items ahead of the consumer.

    The producer's error is raised in the consumer; a consumer that stops early (an error, Ctrl-C) stops
    the producer (``close()``) and waits for it.
    """
    handoff: queue.Queue = queue.Queue(_QUEUE_DEPTH)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as err:  # handed to the consumer, which raises it
            put(_Failed(err))
        finally:
            items.close()  # a stage before this one stops too

    thread = threading.Thread(target=produce, name="prepare-stage", daemon=True)
    thread.start()
    try:
        while (item := handoff.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
