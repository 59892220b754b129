"""``gpuflex train local``: the training runtime on its own, a job's replicas as processes on this machine.

    gpuflex train local --recipe char-gpt --workers 4 --inner-steps 50 --compression int8
    gpuflex train local --inner-optimizer muon --compression int2      # MuLoCo: Muon inside DiLoCo
    gpuflex train local --compression topk --density 0.02 --outer-momentum 0 --error-decay 0.95 \\
        --overlap --bandwidth-mbit 100 --latency-ms 50 --slow-worker 3 --round-seconds 5
    gpuflex train local --prepared ./prepared --workers 2      # what `gpuflex data prepare` wrote
    gpuflex train local --recipe hf-causal-lm --model-from ./my-model --lora-r 8 --precision bf16 \\
        --output-hf ./my-model-tuned

It builds the text to train on (the standard library's source, or the UTF-8 files under
``--data DIR``, whatever their extension; or each task reads its shards of ``--prepared DIR``), runs
``gpuflex.train.local.run_local`` and prints a line per round as it is published, then each worker's
traffic and compute utilization. No coordinator, no marketplace. The torch-heavy runtime is imported
only when the command runs, so ``gpuflex --help`` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from gpuflex.errors import BadRequest, SpecError
from gpuflex.protocol.spec import DataSpec, TrainingSpec, describe_validation_error

if TYPE_CHECKING:
    from gpuflex.train.local import LocalResult, LocalWorker, RoundRecord, WorkerOptions

console = Console()
train_app = typer.Typer(help="Train without the marketplace.", no_args_is_help=True)

STDLIB_EXTENSIONS = [".py"]
SPEC = TrainingSpec()  # the job spec's defaults are the command's


def text_extensions(source: str) -> list[str]:
    """The file extensions to read under ``source``: the standard library's ``.py``, or every extension
    found in the directory (build_corpus then skips the files that are not UTF-8 text)."""
    if source == "stdlib":
        return STDLIB_EXTENSIONS
    root = Path(source).expanduser()
    found = {p.suffix for p in root.rglob("*") if p.suffix and p.is_file()} if root.is_dir() else set()
    return sorted(found) or STDLIB_EXTENSIONS  # none: build_corpus explains what is missing


def build_spec(fields: dict[str, Any]) -> TrainingSpec:
    """A TrainingSpec from the command's options; SpecError naming each bad one."""
    try:
        return TrainingSpec.model_validate(fields)
    except ValidationError as err:
        raise SpecError(f"invalid option: {describe_validation_error(err, TrainingSpec)}") from None


@train_app.command("local")
def local(
    recipe: Annotated[str, typer.Option(help="char-gpt | hf-causal-lm | mlp-digits | user")] = "char-gpt",
    recipe_file: Annotated[Path | None, typer.Option(help="with --recipe user: the recipe's file")] = None,
    workers: Annotated[int, typer.Option(help="worker processes (replicas)")] = 4,
    rounds: Annotated[int, typer.Option(help="outer rounds")] = SPEC.rounds,
    inner_steps: Annotated[int, typer.Option(help="inner steps per round (DiLoCo's H)")] = SPEC.inner_steps,
    inner_optimizer: Annotated[
        str, typer.Option(help="adamw | muon (Muon for the hidden weight matrices, AdamW for the rest)")
    ] = SPEC.inner_optimizer,
    compression: Annotated[
        str, typer.Option(help="none | fp16 | bf16 | int8 | int4 | int2 | topk")
    ] = SPEC.compression.method,
    density: Annotated[
        float, typer.Option(help="topk: the share of each chunk sent")
    ] = SPEC.compression.density,
    values: Annotated[str, typer.Option(help="topk: the codec of the values sent")] = SPEC.compression.values,
    error_decay: Annotated[
        float, typer.Option(help="error feedback's decay (1: keep all)")
    ] = SPEC.compression.error_decay,
    lr: Annotated[float, typer.Option(help="inner learning rate (the peak)")] = SPEC.lr,
    lr_schedule: Annotated[
        str, typer.Option(help="the inner lr over the job: cosine | constant")
    ] = SPEC.lr_schedule,
    batch_size: Annotated[int, typer.Option(help="sequences per inner step")] = SPEC.batch_size,
    outer_lr: Annotated[float, typer.Option(help="outer SGD learning rate")] = SPEC.outer_lr,
    outer_momentum: Annotated[
        float, typer.Option(help="outer Nesterov momentum (0: plain SGD)")
    ] = SPEC.outer_momentum,
    overlap: Annotated[bool, typer.Option(help="compute the next round while this one is exchanged")] = False,
    round_seconds: Annotated[float | None, typer.Option(help="time budget of a round's compute")] = None,
    seed: Annotated[int, typer.Option(help="model initialisation and batches")] = SPEC.seed,
    data: Annotated[str, typer.Option(help="'stdlib' or a directory of text files")] = "stdlib",
    max_bytes: Annotated[int, typer.Option(help="at most this much text")] = DataSpec().max_bytes,
    prepared: Annotated[
        Path | None,
        typer.Option(help="train on a prepared dataset (`gpuflex data prepare`) instead of --data"),
    ] = None,
    bandwidth_mbit: Annotated[float | None, typer.Option(help="each worker's link, Mbit/s each way")] = None,
    latency_ms: Annotated[float, typer.Option(help="each worker's link: latency per call")] = 0.0,
    slow_worker: Annotated[float, typer.Option(help="make worker 0 this many times slower")] = 1.0,
    threads: Annotated[int, typer.Option(help="torch threads per process")] = 1,
    model_from: Annotated[
        Path | None, typer.Option(help="hf-causal-lm: a save_pretrained directory to fine-tune")
    ] = None,
    block_size: Annotated[int, typer.Option(help="tokens per training sequence")] = SPEC.model.block_size,
    lora_r: Annotated[int | None, typer.Option(help="train LoRA adapters of this rank (peft)")] = None,
    lora_alpha: Annotated[float, typer.Option(help="LoRA's alpha")] = 16.0,
    lora_targets: Annotated[
        str, typer.Option(help="LoRA's target modules, comma-separated")
    ] = "q_proj,v_proj",
    precision: Annotated[str, typer.Option(help="fp32 | bf16 | fp16 (autocast)")] = SPEC.precision,
    micro_batch_size: Annotated[
        int | None, typer.Option(help="gradient accumulation: micro-batches of this size")
    ] = None,
    gradient_checkpointing: Annotated[bool, typer.Option(help="hf-causal-lm: recompute activations")] = False,
    output_hf: Annotated[
        Path | None, typer.Option(help="with --model-from: write the result as a Hugging Face directory")
    ] = None,
    merge: Annotated[bool, typer.Option(help="with --output-hf and LoRA: merge the adapters")] = False,
) -> None:
    """Train a job's replicas as local processes; print the loss of every round and each worker's traffic."""
    fields = {
        "recipe": recipe,
        "recipe_file": str(recipe_file) if recipe_file else None,
        "rounds": rounds,
        "inner_steps": inner_steps,
        "inner_optimizer": inner_optimizer,
        "compression": _compression(compression, density, values, error_decay),
        "lr": lr,
        "lr_schedule": lr_schedule,
        "batch_size": batch_size,
        "outer_lr": outer_lr,
        "outer_momentum": outer_momentum,
        "overlap": overlap,
        "round_seconds": round_seconds,
        "seed": seed,
        "model": {"block_size": block_size, "from": str(model_from) if model_from else None},
        "precision": precision,
        "micro_batch_size": micro_batch_size,
        "gradient_checkpointing": gradient_checkpointing,
    }
    if lora_r is not None:
        targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
        fields["lora"] = {"r": lora_r, "alpha": lora_alpha, "target_modules": targets}
    spec = build_spec(fields)
    if output_hf is not None and model_from is None:
        raise BadRequest("--output-hf writes a fine-tune of --model-from: give the model directory")
    options = _worker_options(workers, bandwidth_mbit, latency_ms, slow_worker, threads)
    code = _read(recipe_file) if recipe_file else None
    dataset = _dataset(spec, code, data, max_bytes) if prepared is None else None
    result = _run(spec, dataset, code, options, threads, prepared)
    if output_hf is not None and model_from is not None:
        from gpuflex.train.export import export_hf

        assert result.checkpoint is not None and result.spec is not None, "a finished job has a checkpoint"
        export_hf(result.checkpoint, result.spec, model_from, output_hf, merge=merge)
        console.print(f"Hugging Face model directory written to {output_hf}")


def _compression(method: str, density: float, values: str, error_decay: float) -> dict[str, Any]:
    if method == "topk":
        return {"method": method, "density": density, "values": values, "error_decay": error_decay}
    return {"method": method, "error_decay": error_decay}


def _worker_options(
    workers: int, bandwidth_mbit: float | None, latency_ms: float, slow_worker: float, threads: int
) -> list[WorkerOptions]:
    from gpuflex.train.local import WorkerOptions
    from gpuflex.train.throttle import Link

    if not 1 <= workers <= 256:
        raise BadRequest(f"--workers must be between 1 and 256, got {workers}")
    if bandwidth_mbit is not None and bandwidth_mbit <= 0:
        raise BadRequest(f"--bandwidth-mbit must be positive, got {bandwidth_mbit}")
    if latency_ms < 0:
        raise BadRequest(f"--latency-ms must not be negative, got {latency_ms}")
    if slow_worker < 1:
        raise BadRequest(f"--slow-worker is a slowdown factor, at least 1, got {slow_worker}")
    if threads < 1:
        raise BadRequest(f"--threads must be at least 1, got {threads}")
    throttled = bandwidth_mbit is not None or latency_ms > 0
    link = Link(bandwidth_mbit * 1e6 if bandwidth_mbit else None, latency_ms / 1e3) if throttled else None
    return [WorkerOptions(link=link, slowdown=slow_worker if i == 0 else 1.0) for i in range(workers)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise BadRequest(f"cannot read the recipe file {path}: {err.strerror}") from None


def _dataset(spec: TrainingSpec, code: bytes | None, source: str, max_bytes: int) -> bytes | None:
    """The text to train on, or None if the recipe brings its own data."""
    from gpuflex.train.corpus import build_corpus
    from gpuflex.train.recipes import get_recipe

    if not get_recipe(spec.recipe, code).needs_dataset:
        return None
    return build_corpus(source, max_bytes, text_extensions(source))


def _run(
    spec: TrainingSpec,
    dataset: bytes | None,
    code: bytes | None,
    options: list[WorkerOptions],
    threads: int,
    prepared: Path | None = None,
) -> LocalResult:
    from gpuflex.train.local import run_local

    label = spec.compression.label + (", overlapped" if spec.overlap else "")
    if spec.lora is not None:
        label += f", LoRA r={spec.lora.r}"
    if spec.precision != "fp32":
        label += f", {spec.precision}"
    if spec.inner_optimizer != "adamw":
        label += f", {spec.inner_optimizer} inner steps"
    what = spec.recipe if spec.model.from_ is None else f"{spec.recipe} from {spec.model.from_}"
    console.print(f"training {what} on {len(options)} worker processes, {spec.rounds} rounds ({label})")
    try:
        result = run_local(
            spec,
            dataset,
            len(options),
            options=options,
            recipe_code=code,
            threads=threads,
            on_round=_print_round,
            prepared=prepared,
        )
    except KeyboardInterrupt:
        console.print("interrupted: every task was stopped")
        raise typer.Exit(130) from None
    console.print(_workers_table(result.workers))
    for i, w in enumerate(result.workers):  # a prepared dataset: each read its own shards and validation's
        if w.shards:
            console.print(f"worker-{i} read {', '.join(sorted(w.shards))}", highlight=False)
    last = result.rounds[-1]
    console.print(
        f"final validation loss {_loss(last.val_loss)} after {last.round} rounds and {last.tokens:,} tokens, "
        f"{last.seconds - result.rounds[0].seconds:.1f}s from round 0"
    )
    return result


def _print_round(record: RoundRecord) -> None:
    per_worker = record.uploaded / record.contributions if record.contributions else 0
    console.print(
        f"round {record.round:>3}  val {_loss(record.val_loss)}  train {_loss(record.train_loss)}  "
        f"{record.contributions:>2} in  up {_kb(per_worker)}  down {_kb(record.update)}  "
        f"{record.seconds:6.1f}s",
        highlight=False,
    )


def _workers_table(workers: list[LocalWorker]) -> Table:
    table = Table(title="per worker: bytes on its link, compute time / wall time")
    for column in ("worker", "sent", "received", "compute", "wall", "util", "tokens", "stale"):
        table.add_column(column, justify="left" if column == "worker" else "right")
    for i, w in enumerate(workers):
        s = w.summary
        table.add_row(
            f"worker-{i}",
            _kb(w.link.bytes_up),
            _kb(w.link.bytes_down),
            f"{s.compute_s:.1f}s",
            f"{s.wall_s:.1f}s",
            f"{s.utilization:.1%}",
            f"{s.tokens:,}",
            str(len(s.stale)),
        )
    return table


def _loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def _kb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"
