"""Consumer commands: ``gpuflex submit``, ``quote``, ``jobs``, and the ``job`` group
(``show | logs | cancel | fetch | watch | report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import credits
from gpuflex.cli.profile import consumer_client
from gpuflex.cli.watch import watch_job
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import JobInfo, Quote, Verdict
from gpuflex.protocol.spec import JobSpec, load_job_spec

job_app = typer.Typer(help="Follow and manage one job.", no_args_is_help=True)
console = Console()
JobId = Annotated[str, typer.Argument(help="job id, as `gpuflex jobs` lists it")]
KEYS_PER_ASK = 10_000  # blob keys per `missing_blobs` call (the route's limit)


def upload_inputs(client: Client, spec: JobSpec) -> dict[str, str | None]:
    """Build the job's corpus (unless ``data.source`` is ``none``) and read its user recipe file, on this
    machine, and upload both; returns the ``dataset`` and ``recipe_code`` hashes to submit with."""
    from gpuflex.train.corpus import build_corpus

    dataset = None
    if spec.data.source != "none":
        dataset = client.upload(build_corpus(spec.data.source, spec.data.max_bytes, spec.data.extensions))
    recipe_code = None
    if spec.training.recipe_file is not None:
        try:
            recipe_code = client.upload(Path(spec.training.recipe_file).read_bytes())
        except OSError as err:
            raise BadRequest(f"cannot read recipe_file {spec.training.recipe_file}: {err.strerror}") from None
    return {"dataset": dataset, "recipe_code": recipe_code}


def upload_model(client: Client, spec: JobSpec) -> JobSpec:
    """With ``training.model.from``: check and size the model directory here (``train.pretrained``), upload
    what the blob store lacks of it (files cut into parts at the store's blob limit, one part in memory at
    a time), and return the spec naming it (``model.size``, ``model.uploaded``; ``from`` made absolute, for
    ``job fetch --format hf``). Without it, ``spec`` as it is."""
    if spec.training.model.from_ is None:
        return spec
    from gpuflex.train.pretrained import bundle_model, with_model

    root = Path(spec.training.model.from_).expanduser().resolve()
    training = with_model(spec.training, from_=str(root))
    training, bundle, parts = bundle_model(root, training, client.missing_blobs([]).max_blob_bytes)
    manifest = bundle.to_bytes()
    keys = [p.sha256 for p in parts]
    missing = {
        k
        for i in range(0, len(keys), KEYS_PER_ASK)
        for k in client.missing_blobs(keys[i : i + KEYS_PER_ASK]).missing
    }
    sent = 0
    for part in parts:
        if part.sha256 in missing:
            client.upload(part.read())
            sent += part.size
    client.upload(manifest)
    size = training.model.size
    assert size is not None, "bundle_model sizes the model"
    console.print(
        f"model {root}: {size.parameters:,} parameters ({size.trainable:,} trained), "
        f"{len(bundle.files)} files; uploaded {len(missing)} of {len(parts)} blobs ({sent / 1e6:.1f} MB), "
        "the rest already stored",
        highlight=False,
    )
    return spec.model_copy(update={"training": training})


def submit(
    spec_file: Annotated[Path, typer.Argument(help="job spec YAML", metavar="JOB.yaml")],
    watch: Annotated[bool, typer.Option(help="follow the job until it ends")] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Submit a job from a YAML spec; its budget moves into escrow. It starts once its aggregator and
    resources.min_workers workers (default: all) can be placed together; until then it waits, and
    this says why."""
    spec = load_job_spec(spec_file)
    client = consumer_client(url, token)
    spec = upload_model(client, spec)
    inputs = upload_inputs(client, spec)
    unplaced = _unplaced(client, spec)  # before submitting: what the job's first placement will find
    job = client.submit(spec, **inputs)
    console.print(f"submitted job [bold]{job.id}[/] ({job.name}); budget {job.budget:.2f} credits in escrow")
    if unplaced:
        console.print(unplaced[0], style="yellow", highlight=False)
        for why in unplaced[1:]:
            console.print(f"  {why}", highlight=False)
        console.print(f"`gpuflex job show {job.id}` says why each task waits", highlight=False)
    if watch:
        _summary(watch_job(client, job.id, console))


def _unplaced(client: Client, spec: JobSpec) -> list[str]:
    """What the market could not place of ``spec`` now, from a quote (nothing spent): a headline, then
    why, node by node; empty when it can place everything."""
    try:
        q = client.quote(spec)
    except BadRequest:  # a user recipe without round_seconds is not quoted; `job show` tells placement
        return []
    if not q.placeable:
        return ["the job waits: it cannot start now", *q.problems]
    if q.waiting:
        return [
            "the job starts on fewer workers than it asks for; the others join as nodes free up",
            *q.waiting,
        ]
    return []


def quote(
    spec_file: Annotated[Path, typer.Argument(help="job spec YAML", metavar="JOB.yaml")],
    url: Url = None,
    token: Token = None,
) -> None:
    """What a job would cost and take if submitted now, and on which nodes; nothing is spent."""
    spec = load_job_spec(spec_file)
    if spec.training.model.from_ is not None:  # the market sizes the job by the model directory's counts
        from gpuflex.train.pretrained import sized

        spec = spec.model_copy(update={"training": sized(spec.training)})
    q = consumer_client(url, token).quote(spec)
    _warn_if_short(q)
    if q.vram_estimate_gb is not None and spec.resources.min_vram_gb is None:
        console.print(
            f"memory: a worker on a GPU needs ≈ {q.vram_estimate_gb:.1f} GB of VRAM by the market's estimate "
            "(set resources.min_vram_gb to choose yourself)",
            highlight=False,
        )
    if not q.placeable:
        console.print("[bold yellow]the job cannot be placed now:[/]", highlight=False)
        for problem in q.problems:
            console.print(f"  {problem}", highlight=False)
        raise typer.Exit(1)
    console.print(_quote_nodes(q))
    for waiting in q.waiting:
        console.print(waiting, style="yellow", highlight=False)
    span = f"{_duration(q.duration_low_s)}–{_duration(q.duration_high_s)}"
    console.print(
        f"duration ≈ {_duration(q.duration_s)} ({span})\n"
        f"cost ≈ {q.cost:.6f} credits ({q.cost_low:.6f}–{q.cost_high:.6f}) of a {q.budget:.2f} budget",
        highlight=False,
    )
    if q.clearing_price is not None:
        console.print(f"auction: every worker paid the clearing price {q.clearing_price:.3f} credits/h")
    if q.budget_lasts_s is not None:
        console.print(f"[bold yellow]the budget runs out first, after ≈ {_duration(q.budget_lasts_s)}[/]")
    if q.shirking_pays_rounds:
        remedy = (
            "nothing is audited: set verification.audit_rate"
            if q.slash_to_deter is None
            else f"a verification.slash of {q.slash_to_deter:.6f} credits (or a higher audit rate) deters it"
        )
        rounds = q.shirking_pays_rounds
        console.print(
            f"[yellow]shirking pays in expectation in the first {rounds} rounds: a worker that skips "
            f"part of a round saves more than it risks; {remedy}[/]",
            highlight=False,
        )
    for assumption in q.assumptions:
        console.print(f"[dim]assumes {assumption}[/]", highlight=False)


def _warn_if_short(q: Quote) -> None:
    """Say now what ``submit`` would refuse: a budget the wallet does not cover."""
    if q.wallet is not None and q.wallet < q.budget:
        missing = credits(q.budget - q.wallet)
        console.print(
            f"[bold yellow]your wallet holds {credits(q.wallet)} credits and this job's budget is "
            f"{credits(q.budget)}: submit would be refused; add {missing} with "
            f"`gpuflex wallet deposit {missing}`, or lower the budget[/]",
            highlight=False,
        )


def _quote_nodes(q: Quote) -> Table:
    columns = ("role", "node", "name", "kind", "TFLOPS", "ask/h", "paid/h", "s/step")
    table = Table(*columns, title="assumed nodes")
    for n in q.nodes:
        step = "-" if n.seconds_per_step is None else f"{n.seconds_per_step:.4f}"
        row = (n.role, n.node_id, n.name, n.kind, f"{n.tflops:.3f}", f"{n.ask:.3f}", f"{n.paid:.3f}", step)
        table.add_row(*row)
    return table


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def list_jobs(url: Url = None, token: Token = None) -> None:
    """List your jobs."""
    table = Table("id", "name", "state", "round", "val loss", "spent", "budget")
    for j in consumer_client(url, token).jobs():
        table.add_row(
            j.id,
            j.name,
            j.state,
            f"{j.round}/{j.rounds}",
            _f(j.val_loss),
            f"{j.spent:.6f}",
            f"{j.budget:.2f}",
        )
    console.print(table)


@job_app.command("show")
def show(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """A job's state, its tasks (and why each node was chosen), rounds, costs and verdicts."""
    job = consumer_client(url, token).job(job_id)
    _summary(job)
    clearing = "" if job.clearing_price is None else f"; clearing price {job.clearing_price:.3f} credits/h"
    console.print(f"pricing: {job.spec.pricing}{clearing}", highlight=False)
    tasks = Table("task", "role", "state", "node", "epoch", "why this node, or why none", title="tasks")
    for t in job.tasks:
        tasks.add_row(t.id, f"{t.role} {t.index}", t.state, t.node_id or "-", str(t.epoch), t.placement)
    rounds = Table("round", "val loss", "train loss", "contributions", title="rounds")
    for r in job.rounds_log:
        rounds.add_row(str(r.round), _f(r.val_loss), _f(r.train_loss), str(r.contributions))
    costs = Table("node", "name", "kind", "seconds", "credits", title="costs")
    for c in job.costs:
        costs.add_row(c.node_id, c.name, c.kind, f"{c.seconds:.1f}", f"{c.cost:.6f}")
    for table in (tasks, rounds, costs):
        console.print(table)
    if job.verdicts:
        console.print(verdict_table(job.verdicts))


def verdict_table(verdicts: list[Verdict]) -> Table:
    """What verification found, newest first: a guilty node was slashed and barred from the job."""
    table = Table(
        "round", "task", "node", "check", "verdict", "slashed", "withheld", "reason", title="verdicts"
    )
    for v in verdicts:
        outcome = "[red]guilty[/red]" if v.guilty else "[green]clean[/green]"
        table.add_row(
            str(v.round),
            v.task_id,
            v.node_id,
            v.check,
            outcome,
            f"{v.slashed:.6f}",
            f"{v.withheld:.6f}",
            v.reason,
        )
    return table


@job_app.command("logs")
def logs(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """A job's event log: placements, leases, rounds, failures."""
    for e in consumer_client(url, token).logs(job_id):
        console.print(f"[dim]{e.at:%H:%M:%S}[/] {e.message}", markup=True, highlight=False)


@job_app.command("cancel")
def cancel(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """Cancel a job: providers are paid for time used, the rest is refunded."""
    job = consumer_client(url, token).cancel(job_id)
    console.print(f"job {job.id} {job.state}; spent {job.spent:.6f} credits, the rest refunded")


@job_app.command("fetch")
def fetch(
    job_id: JobId,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="file (safetensors) or, with --format hf, directory")
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="safetensors: the checkpoint as is; hf: a Hugging Face directory")
    ] = "safetensors",
    merge: Annotated[
        bool, typer.Option(help="--format hf of a LoRA job: merge the adapters into the base")
    ] = False,
    base: Annotated[
        Path | None,
        typer.Option(help="--format hf: the job's model directory, if not where it was submitted from"),
    ] = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """Download a job's final checkpoint: safetensors as trained, or with --format hf a directory that
    transformers loads (for LoRA, the adapter over the base, or --merge for merged weights)."""
    if fmt not in ("safetensors", "hf"):
        raise BadRequest(f"--format is safetensors or hf, not {fmt!r}")
    client = consumer_client(url, token)
    if fmt == "safetensors":
        output = output or Path(f"{job_id}.safetensors")
        output.write_bytes(client.checkpoint(job_id))
        console.print(f"checkpoint written to {output}")
        return
    from gpuflex.train.export import export_hf
    from gpuflex.train.pretrained import same_model

    training = client.job(job_id).spec.training
    if training.model.from_ is None or training.model.uploaded is None:
        raise BadRequest(
            f"job {job_id} did not fine-tune a model directory: fetch its safetensors checkpoint"
        )
    root = base or Path(training.model.from_)
    if not root.is_dir() or not same_model(root, training.model.uploaded):
        raise BadRequest(
            f"{root} is not the model directory job {job_id} was submitted with (its files differ, or it is "
            "not on this machine): pass it with --base"
        )
    output = output or Path(job_id)
    export_hf(client.checkpoint(job_id), training, root, output, merge=merge)
    kind = "merged model" if merge else "LoRA adapter" if training.lora else "model"
    console.print(f"{kind} written to {output} (transformers loads it with from_pretrained)")


@job_app.command("watch")
def watch(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """Follow a job live until it ends: round, losses, live workers, credits spent."""
    _summary(watch_job(consumer_client(url, token), job_id, console))


@job_app.command("report")
def report(
    job_id: JobId,
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG of the loss curve")] = Path(
        "report.png"
    ),
    url: Url = None,
    token: Token = None,
) -> None:
    """Write a job's loss curve (PNG) and cost table (CSV beside it); print the costs."""
    from gpuflex.cli.report import cost_table, write_report

    job = consumer_client(url, token).job(job_id)
    table_path = write_report(job, output)
    console.print(cost_table(job))
    console.print(f"loss curve written to {output}; cost table to {table_path}")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _summary(job: JobInfo) -> None:
    console.print(
        f"job [bold]{job.id}[/] {job.name}: {job.state}{' (' + job.reason + ')' if job.reason else ''}; "
        f"round {job.round}/{job.rounds}; val loss {_f(job.initial_val_loss)} -> {_f(job.val_loss)}; "
        f"spent {job.spent:.6f} of {job.budget:.2f} credits"
    )
