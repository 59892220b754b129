"""``gpuflex data``: datasets prepared on this machine, before a job trains on them.

    gpuflex data prepare ./corpus/*.jsonl --field text --tokenizer ./my-model -o ./prepared
    gpuflex data prepare ./books/ --bytes -o ./prepared --shard-tokens 4194304 --val-tokens 100000
    gpuflex data prepare s3://bucket/part-*.parquet --column content --tokenizer tokenizer.json -o ./p

It tokenizes the inputs with ``gpuflex.data.prepare`` into token shards and a ``manifest.json`` under
``-o``, with a progress bar of the bytes read and the tokens written, and prints what it wrote.
pyarrow and tokenizers are imported only when the command runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

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

from gpuflex.data.shards import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION
from gpuflex.errors import BadRequest

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
