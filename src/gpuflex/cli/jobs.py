"""Consumer commands: ``gpuflex submit``, ``quote``, ``jobs``, and the ``job`` group
(``show | logs | cancel | fetch | watch | report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpuflex.cli.data import upload_prepared
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


def upload_inputs(client: Client, spec: JobSpec) -> dict[str, str | None]:
    """Upload the job's data — a prepared dataset's shards the blob store lacks and its manifest, or the
    corpus built from ``data.source`` (unless ``none``) — and its user recipe file, from this machine;
    returns the ``dataset`` and ``recipe_code`` hashes to submit with."""
    from gpuflex.train.corpus import build_corpus

    dataset = None
    if spec.data.prepared is not None:
        up = upload_prepared(client, spec, Path(spec.data.prepared).expanduser())
        there = f"; the other {up.shards - up.sent} were there already" if up.sent < up.shards else ""
        sent = f"uploaded {up.sent} of {up.shards} shards ({up.sent_bytes:,} bytes)"
        console.print(f"dataset {up.manifest}: {sent}{there}", highlight=False)
        dataset = up.manifest
    elif spec.data.source is not None and spec.data.source != "none":
        dataset = client.upload(build_corpus(spec.data.source, spec.data.max_bytes, spec.data.extensions))
    recipe_code = None
    if spec.training.recipe_file is not None:
        try:
            recipe_code = client.upload(Path(spec.training.recipe_file).read_bytes())
        except OSError as err:
            raise BadRequest(f"cannot read recipe_file {spec.training.recipe_file}: {err.strerror}") from None
    return {"dataset": dataset, "recipe_code": recipe_code}


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
    q = consumer_client(url, token).quote(load_job_spec(spec_file))
    _warn_if_short(q)
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
    output: Annotated[Path | None, typer.Option("-o", "--output", help="file to write")] = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """Download a job's final checkpoint (safetensors)."""
    output = output or Path(f"{job_id}.safetensors")
    output.write_bytes(consumer_client(url, token).checkpoint(job_id))
    console.print(f"checkpoint written to {output}")


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
