"""``gpuflex data``: datasets prepared on this machine, before a job trains on them.

    gpuflex data prepare ./corpus/*.jsonl --field text --tokenizer ./my-model -o ./prepared
    gpuflex data prepare ./books/ --bytes -o ./prepared --shard-tokens 4194304 --val-tokens 100000
    gpuflex data prepare s3://bucket/part-*.parquet --column content --tokenizer tokenizer.json -o ./p

It tokenizes the inputs with ``gpuflex.data.prepare`` into token shards and a ``manifest.json`` under
``-o``, with a progress bar of the bytes read and the tokens written, and prints what it wrote.
pyarrow and tokenizers are imported only when the command runs.

``check_prepared`` and ``send_prepared`` are ``gpuflex submit``'s side of a job with ``data.prepared``:
the first checks every shard against the manifest and the manifest against the job, before anything
large is uploaded; the second uploads only the blobs the coordinator lacks (one ``POST
/v1/blobs/missing`` for all of them), so an interrupted upload or a second job on the same data sends
nothing twice.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from gpuflex.data.manifest import Manifest, Shard, numpy_dtype, read_manifest
from gpuflex.data.shards import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION
from gpuflex.errors import BadRequest, HashMismatch

if TYPE_CHECKING:
    from gpuflex.client import Client
    from gpuflex.protocol.spec import JobSpec

console = Console()
data_app = typer.Typer(help="Datasets: tokenize and shard them for jobs.", no_args_is_help=True)


@data_app.command("prepare")
def prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="files, directories, globs or fsspec URLs: text, .jsonl, .parquet, .arrow, datasets dirs"
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="the directory to write shards and manifest to")
    ],
    field: Annotated[str, typer.Option(help="JSON Lines: the field holding each document's text")] = "text",
    column: Annotated[
        str, typer.Option(help="Parquet, Arrow, datasets: the column holding the text")
    ] = "text",
    tokenizer: Annotated[
        str | None, typer.Option(help="a model directory with tokenizer.json, or a tokenizer.json")
    ] = None,
    as_bytes: Annotated[
        bool, typer.Option("--bytes", help="byte-level ids (vocabulary 256): the default without --tokenizer")
    ] = False,
    shard_tokens: Annotated[int, typer.Option(min=1, help="tokens per shard")] = DEFAULT_SHARD_TOKENS,
    val_tokens: Annotated[
        int | None, typer.Option(min=1, help="the last this many tokens are the validation split")
    ] = None,
    val_fraction: Annotated[
        float, typer.Option(min=0, max=1, help="without --val-tokens: this share of the tokens is validation")
    ] = DEFAULT_VAL_FRACTION,
    workers: Annotated[
        int | None, typer.Option(min=1, help="tokenizer threads (default: one per CPU core)")
    ] = None,
    force: Annotated[bool, typer.Option(help="replace a prepared dataset already in --output")] = False,
) -> None:
    """Tokenize text into fixed-size token shards and a manifest a job can train on."""
    if tokenizer is not None and as_bytes:
        raise BadRequest("give --tokenizer or --bytes, not both")
    if workers is not None:
        os.environ["RAYON_NUM_THREADS"] = str(workers)  # read once, when tokenizers starts its thread pool
    from gpuflex.data.prepare import prepare as run
    from gpuflex.data.sources import Source
    from gpuflex.data.tokenizer import load_tokenizer

    encoder = load_tokenizer(tokenizer)
    source = Source(inputs, field=field, column=column)
    started = time.perf_counter()
    with Progress(
        TextColumn("[bold]reading"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("prepare", total=source.total_bytes, tokens="")
        written = 0

        def advance(bytes_read: int, tokens: int) -> None:
            nonlocal written
            written += tokens
            rate = written / max(time.perf_counter() - started, 1e-9)
            bar.update(task, advance=bytes_read, tokens=f"{written:,} tokens ({rate:,.0f}/s)")

        manifest = run(
            source,
            encoder,
            output,
            shard_tokens=shard_tokens,
            val_tokens=val_tokens,
            val_fraction=val_fraction,
            force=force,
            progress=advance,
        )
    shards = len(manifest.train) + len(manifest.validation)
    console.print(
        f"{shards} shards of {manifest.dtype} ({len(manifest.train)} train, {len(manifest.validation)} "
        f"validation): {manifest.tokens:,} tokens from {manifest.documents:,} documents "
        f"in {time.perf_counter() - started:.1f} s\n"
        f"validation: the last {manifest.validation_tokens:,} tokens\n"
        f"manifest: {output / 'manifest.json'} (sha256 {manifest.digest})",
        highlight=False,
        soft_wrap=True,
    )


@dataclass(frozen=True)
class Uploaded:
    manifest: str  # the manifest's blob key: the job's dataset
    shards: int  # shards the dataset has
    sent: int  # of them, uploaded now: the blob store lacked them
    sent_bytes: int


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset checked here: every shard's hash, and the manifest against the job."""

    directory: Path
    manifest: Manifest


def upload_prepared(
    client: Client, spec: JobSpec, directory: Path, seal: Callable[[bytes], bytes] | None = None
) -> Uploaded:
    """Check the prepared dataset in ``directory`` (``check_prepared``, ``stage_prepared``), then upload
    what the blob store lacks of it (``send_prepared``)."""
    prepared = check_prepared(spec, directory)
    stage_prepared(client, prepared, sealed=seal is not None)
    return send_prepared(client, prepared, seal)


def check_prepared(spec: JobSpec, directory: Path) -> Prepared:
    """The prepared dataset in ``directory``, checked against ``spec`` (``data.fit``'s rules, the model's
    vocabulary as ``model.size`` counts it) and every shard against its hash, with a progress bar."""
    from gpuflex.data.fit import check_job

    manifest = read_manifest(directory)
    check_job(manifest, spec)
    shards = manifest.train + manifest.validation
    itemsize = numpy_dtype(manifest.dtype).itemsize
    with _progress() as bar:
        checking = bar.add_task("checking", total=manifest.tokens * itemsize)
        for shard in shards:
            _check_shard(directory, shard, lambda n: bar.update(checking, advance=n))
    return Prepared(directory, manifest)


def stage_prepared(client: Client, prepared: Prepared, *, sealed: bool) -> str:
    """What is checked of a dataset before anything large is uploaded: no shard is over the coordinator's
    blob limit, and (unless ``sealed``: the coordinator never reads an encrypted job's) its manifest,
    small, is in the store for ``POST /v1/jobs/check`` to read. Returns the manifest's hash."""
    manifest = prepared.manifest
    answer = client.missing_blobs([] if sealed else [manifest.digest])
    itemsize = numpy_dtype(manifest.dtype).itemsize
    _refuse_too_large(manifest.train + manifest.validation, itemsize, answer.max_blob_bytes)
    if answer.keys:
        client.upload(manifest.to_bytes())
    return manifest.digest


def send_prepared(
    client: Client, prepared: Prepared, seal: Callable[[bytes], bytes] | None = None
) -> Uploaded:
    """Upload the shards and the manifest of a dataset checked and staged that the blob store lacks, with a
    progress bar.

    With ``seal`` (``privacy.encrypt``), every shard is sent through it (none is in the store: each
    ciphertext is new) and the manifest sent names each shard by its ciphertext's hash, through it too."""
    directory, manifest = prepared.directory, prepared.manifest
    shards = manifest.train + manifest.validation
    itemsize = numpy_dtype(manifest.dtype).itemsize
    keys = [] if seal is not None else [s.sha256 for s in shards] + [manifest.digest]
    missing = client.missing_blobs(keys)
    lacking = [s for s in shards if seal is not None or s.sha256 in set(missing.keys)]
    with _progress() as bar:
        sending = bar.add_task("uploading", total=sum(s.tokens for s in lacking) * itemsize)
        stored: dict[str, str] = {}  # a shard's hash -> the hash it is stored by
        for shard in lacking:
            data = (directory / shard.file).read_bytes()
            stored[shard.sha256] = client.upload(seal(data) if seal is not None else data)
            bar.update(sending, advance=shard.tokens * itemsize)
    sent_bytes = sum(s.tokens for s in lacking) * itemsize
    if seal is not None:
        dataset = client.upload(seal(_renamed(manifest, stored).to_bytes()))
        return Uploaded(dataset, len(shards), len(lacking), sent_bytes)
    if manifest.digest in missing.keys:
        client.upload(manifest.to_bytes())
    return Uploaded(manifest.digest, len(shards), len(lacking), sent_bytes)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:>9}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=console,
    )  # fmt: skip


def _renamed(manifest: Manifest, stored: dict[str, str]) -> Manifest:
    """``manifest`` naming each shard by the hash it is stored by (an encrypted shard's: its ciphertext's)."""

    def renamed(shards: list[Shard]) -> list[Shard]:
        return [s.model_copy(update={"sha256": stored[s.sha256]}) for s in shards]

    return manifest.model_copy(
        update={"train": renamed(manifest.train), "validation": renamed(manifest.validation)}
    )


def _check_shard(directory: Path, shard: Shard, advance) -> None:
    digest = hashlib.sha256()
    try:
        with open(directory / shard.file, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
                advance(len(chunk))
    except FileNotFoundError:
        raise BadRequest(f"shard {shard.file} of the prepared dataset {directory} is missing") from None
    if digest.hexdigest() != shard.sha256:
        raise HashMismatch(
            f"shard {shard.file} of {directory} hashes to {digest.hexdigest()}, its manifest says "
            f"{shard.sha256}: the directory changed after `gpuflex data prepare` wrote it; prepare it again"
        )


def _refuse_too_large(shards: list[Shard], itemsize: int, limit: int) -> None:
    big = next((s for s in shards if s.tokens * itemsize > limit), None)
    if big is not None:
        raise BadRequest(
            f"shard {big.file} is {big.tokens * itemsize:,} bytes, more than the coordinator's blob limit of "
            f"{limit:,}: prepare the data again with --shard-tokens {limit // itemsize} or less"
        )
