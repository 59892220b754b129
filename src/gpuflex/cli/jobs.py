"""Consumer commands: ``gpuflex submit``, ``quote``, ``jobs``, and the ``job`` group
(``show | logs | cancel | fetch | watch | report | keys``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gpuflex.cli import keys as data_keys
from gpuflex.cli.inputs import check_inputs, read_inputs, upload_model, upload_read
from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import Json, at_least, credits, print_json, settled, table
from gpuflex.cli.profile import consumer_client
from gpuflex.cli.report import cost_table, write_report
from gpuflex.cli.watch import EXIT_CODES, TERMINAL, watch_job
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import DPStatus, JobEvent, JobInfo, Quote, Verdict
from gpuflex.protocol.spec import JobSpec, load_job_spec

job_app = typer.Typer(help="Follow and manage one job.", no_args_is_help=True)
console = Console()
JobId = Annotated[str, typer.Argument(help="job id as `gpuflex jobs` lists it, or any unique prefix of it")]
job_app.command("keys")(data_keys.keys)


def submit(
    spec_file: Annotated[Path, typer.Argument(help="job spec YAML", metavar="JOB.yaml")],
    watch: Annotated[
        bool, typer.Option(help="follow the job until it ends; exits as `job watch` does")
    ] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Submit a job from a YAML spec; its budget moves into escrow. It starts once its aggregator and
    resources.min_workers workers (default: all) can be placed together; until then it waits, and
    this says why.

    With privacy.encrypt, the dataset, recipe file and model directory are encrypted here first, under a
    data key made here and sealed to this machine's key (~/.gpuflex/sealing.key); the job's nodes get
    that key only while something here serves it: --watch does, or `gpuflex job keys JOB`.

    With --watch, exit code: 0 completed, 3 failed, 4 cancelled, 5 out_of_budget, 130 stopped watching
    (Ctrl-C; the job goes on)."""
    spec = _sized(load_job_spec(spec_file))
    client = consumer_client(url, token)
    # before anything large is uploaded or anything spent: what the job's first placement will find, what
    # its budget buys, what this machine can check of its data, and every rule the coordinator applies
    q = _quoted(client, spec)
    unplaced, short = ([], None) if q is None else (_unplaced(q), _short_budget(q, spec.training.rounds))
    key = data_keys.new_job_key() if spec.privacy.encrypt else None
    sealed_key = key.sealed if key is not None else None
    inputs = read_inputs(spec)
    check_inputs(client, spec, inputs, sealed_key)
    spec = upload_model(client, spec, key)
    uploaded = upload_read(client, inputs, key.seal if key is not None else None)
    job = client.submit(spec, **uploaded, sealed_key=sealed_key)
    console.print(
        f"submitted job [bold]{job.id}[/] ({job.name}); budget {credits(job.budget)} credits in escrow"
    )
    if short:
        console.print(short, style="yellow", highlight=False)
    if spec.privacy.dp is not None:  # what the coordinator found of the noise, once it knew the owners
        for event in client.logs(job.id):
            if event.message.startswith("privacy.dp: warning"):
                console.print(event.message, style="yellow", highlight=False)
    if unplaced:
        console.print(unplaced[0], style="yellow", highlight=False)
        for why in unplaced[1:]:
            console.print(f"  {why}", highlight=False)
        console.print(f"`gpuflex job show {job.id}` says why each task waits", highlight=False)
    if spec.privacy.encrypt and not watch:
        console.print(
            f"encrypted: its nodes get the data key only while `gpuflex job keys {job.id}` runs",
            highlight=False,
        )
    if watch:
        _follow(client, job.id, consumer_client(url, token) if spec.privacy.encrypt else None)


def _quoted(client: Client, spec: JobSpec) -> Quote | None:
    """A quote of ``spec`` (nothing spent); None for a user recipe without round_seconds, which is not
    quoted (`job show` tells its placement)."""
    try:
        return client.quote(spec)
    except BadRequest:
        return None


def _short_budget(q: Quote, rounds: int) -> str | None:
    """Refuse a budget that cannot pay the job's first round on the quoted nodes, even at the quote's
    quickest (it could only end out of budget, having published nothing); a warning when it runs out
    before the quote's quickest end."""
    if q.budget_lasts_s is None or q.duration_low_s is None:  # it lasts, or the job cannot be placed now
        return None
    per_s = q.budget / q.budget_lasts_s  # what the quoted nodes cost together, credits a second
    first_round_s = q.duration_low_s / rounds
    if q.budget_lasts_s < first_round_s:
        raise BadRequest(
            f"a budget of {credits(q.budget)} credits pays ≈ {_duration(q.budget_lasts_s)} of this job's "
            f"nodes, not its first round (≈ {_duration(first_round_s)} at the quickest): give a budget of "
            f"{at_least(per_s * first_round_s)} credits or more (`gpuflex quote` says what the job costs)"
        )
    if q.budget_lasts_s >= q.duration_low_s:
        return None
    return (
        f"the budget runs out after ≈ {_duration(q.budget_lasts_s)}, before the job can end (≈ "
        f"{_duration(q.duration_low_s)} at the quickest): it would end out_of_budget; the quote's low end "
        f"is {at_least(per_s * q.duration_low_s)} credits"
    )


def _unplaced(q: Quote) -> list[str]:
    """What the market could not place of the job quoted ``q`` now: a headline, then why, node by node;
    empty when it can place everything."""
    if q.too_big is not None and not q.placeable:
        raise BadRequest(f"no online node can hold this job's workers: {q.too_big}")
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
    spec = _sized(load_job_spec(spec_file))
    q = consumer_client(url, token).quote(spec)
    _warn_if_short(q)
    if q.vram_estimate_gb is not None and spec.resources.min_vram_gb is None:
        devices = spec.training.local_devices
        on = f" on each of {devices} GPUs" if devices > 1 else ""
        console.print(
            f"memory: a worker on a GPU needs ≈ {q.vram_estimate_gb:.1f} GB of VRAM{on} by the market's "
            f"estimate, and ≈ {q.host_estimate_gb or 0:.1f} GB of host memory "
            "(set resources.min_vram_gb to choose yourself)",
            highlight=False,
        )
    if q.too_big is not None:
        console.print(q.too_big, style="yellow", highlight=False)
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


def _sized(spec: JobSpec) -> JobSpec:
    """``spec`` with its model directory's counts (``model.from``), which the market sizes the job by."""
    if spec.training.model.from_ is None:
        return spec
    from gpuflex.train.pretrained import sized

    return spec.model_copy(update={"training": sized(spec.training)})


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
    nodes = table(*columns, ids=["node"], title="assumed nodes")
    for n in q.nodes:
        step = "-" if n.seconds_per_step is None else f"{n.seconds_per_step:.4f}"
        row = (n.role, n.node_id, n.name, n.kind, f"{n.tflops:.3f}", f"{n.ask:.3f}", f"{n.paid:.3f}", step)
        nodes.add_row(*row)
    return nodes


def _duration(seconds: float) -> str:
    if seconds < 10:  # a budget that lasts a fraction of a round
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def list_jobs(as_json: Json = False, url: Url = None, token: Token = None) -> None:
    """List your jobs."""
    jobs = consumer_client(url, token).jobs()
    if as_json:
        print_json(jobs)
        return
    listed = table("id", "name", "state", "round", "val loss", "spent", "budget", ids=["id"], drop=["budget"])
    for j in jobs:
        row = (j.id, j.name, j.state, f"{j.round}/{j.rounds}", _f(j.val_loss), credits(j.spent))
        listed.add_row(*row, credits(j.budget))
    console.print(listed)


@job_app.command("show")
def show(job_id: JobId, as_json: Json = False, url: Url = None, token: Token = None) -> None:
    """A job's state, its tasks (and why each node was chosen), rounds, costs and verdicts."""
    job = consumer_client(url, token).job(job_id)
    if as_json:
        print_json(job)
        return
    _summary(job)
    clearing = "" if job.clearing_price is None else f"; clearing price {job.clearing_price:.3f} credits/h"
    console.print(f"pricing: {job.spec.pricing}{clearing}", highlight=False)
    tasks = table("task", "role", "state", "node", "epoch", ids=["task", "node"], title="tasks")
    for t in job.tasks:
        tasks.add_row(t.id, f"{t.role} {t.index}", t.state, t.node_id or "-", str(t.epoch))
    console.print(tasks)
    if job.owners:
        owners = table("node", "name", "dataset", "tokens", ids=["node"], title="owners (data.federated)")
        for o in job.owners:
            owners.add_row(o.node_id, o.name, o.dataset, f"{o.tokens:,}")
        console.print(owners)
    # below the table, not in a column of it: a reason is a sentence, which a column squeezed to fit
    # 80 columns beside the ids would wrap to a dozen lines
    for t in job.tasks:
        if t.placement:
            console.print(f"{t.role} {t.index}: {t.placement}", markup=False, highlight=False)
    if job.privacy is not None:
        console.print(_privacy_line(job.privacy), highlight=False)
    if job.key_waits:
        waiting = ", ".join(job.key_waits)
        console.print(
            f"privacy.encrypt: {waiting} wait(s) for the data key: run `gpuflex job keys {job.id}`",
            style="yellow",
            highlight=False,
        )
    accounted = job.privacy is not None and job.privacy.delta is not None
    columns = ("round", "val loss", "train loss", "contributions") + (("ε",) if accounted else ())
    rounds = table(*columns, title="rounds")
    for r in job.rounds_log:
        epsilon = (f"{r.epsilon:.3f}" if r.epsilon is not None else "-",) if accounted else ()
        rounds.add_row(str(r.round), _f(r.val_loss), _f(r.train_loss), str(r.contributions), *epsilon)
    console.print(rounds)
    console.print(cost_table(job))
    if job.verdicts:
        console.print(verdict_table(job.verdicts))


def _privacy_line(p: DPStatus) -> str:
    """``privacy.dp: ε 1.23 spent of target 4 (δ 1e-05); clip 1, noise multiplier 2; 6 rounds``."""
    if p.delta is None:
        spent = "ε not accounted (no delta)"
    else:
        target = f" of target {p.target_epsilon:g}" if p.target_epsilon is not None else ""
        spent = f"ε {p.epsilon or 0:.3f} spent{target} (δ {p.delta:g})"
    noise = f"clip {p.clip:g}, noise multiplier {p.noise_multiplier:.4g}"
    return f"privacy.dp: {spent}; {noise}; {p.rounds} rounds"


def verdict_table(verdicts: list[Verdict], what: str = "round") -> Group:
    """What verification found, newest first: a guilty node was slashed and barred from the job. The
    checks' reasons follow the table, one line each, so it fits 80 columns with its ids whole. ``what``
    the verdict's number counts: a job's round, a deployment's audit."""
    verdict_rows = table(
        what, "task", "node", "verdict", "slashed", "withheld", ids=["task", "node"], title="verdicts"
    )
    reasons = []
    for v in verdicts:
        outcome = "[red]guilty[/red]" if v.guilty else "[green]clean[/green]"
        row = (str(v.round), v.task_id, v.node_id, outcome, credits(v.slashed), credits(v.withheld))
        verdict_rows.add_row(*row)
        reasons.append(Text(f"{what} {v.round}, task {v.task_id} ({v.check}): {v.reason}"))
    return Group(verdict_rows, *reasons)


@job_app.command("logs")
def logs(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """A job's event log: placements, leases, rounds, failures, and its tasks' own lines, each headed by
    who wrote it (`\\[worker 1 on NAME (NODE_ID)]`)."""
    print_events(consumer_client(url, token).logs(job_id))


def print_events(events: list[JobEvent]) -> None:
    """A job's or deployment's log, a line each with its time."""
    for e in events:
        # escaped: a line's head ``[worker 1 on …]`` would otherwise be taken for markup, and vanish
        console.print(f"[dim]{e.at:%H:%M:%S}[/] {escape(e.message)}", highlight=False)


@job_app.command("cancel")
def cancel(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """Cancel a job: providers are paid for time used, the rest is refunded."""
    job = consumer_client(url, token).cancel(job_id)
    console.print(settled(f"job {job.id}", job.state, job.spent, job.budget))


@job_app.command("fetch")
def fetch(
    job_id: JobId,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="file (safetensors), or directory with --format hf \\[default: JOB_ID.safetensors, JOB_ID/]",
        ),
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
    """Download a job's model: the final one once the job completed; before that, or if it failed or was
    cancelled, its newest checkpoint, and it says of which round. As safetensors (the checkpoint as
    trained) or, with --format hf, a directory that transformers loads (for LoRA, the adapter over the
    base, or --merge for merged weights)."""
    if fmt not in ("safetensors", "hf"):
        raise BadRequest(f"--format is safetensors or hf, not {fmt!r}")
    client = consumer_client(url, token)
    data = client.checkpoint(job_id)
    job = client.job(job_id)  # read after the download: its rounds include the one the checkpoint is of
    digest = hashlib.sha256(data).hexdigest()
    key = data_keys.job_data_key(client, job.id) if job.spec.privacy.encrypt else None
    if key is not None:
        data = data_keys.open_checkpoint(key, data)
    of_round = next((r.round for r in job.rounds_log if r.checkpoint == digest), job.round)
    if fmt == "safetensors":
        output = output or Path(f"{job.id}.safetensors")
        output.write_bytes(data)
        what, final = "checkpoint", "model"
    else:
        output = output or Path(job.id)
        what = final = _export_hf(job, data, output, base, merge, key)
    if job.state == "completed" and digest == job.checkpoint:
        console.print(
            f"final {final} of job {job.id} (round {of_round}) written to {output}", highlight=False
        )
        return
    status = (
        f"is still {job.state} (round {job.round}/{job.rounds}): fetch again once it completes"
        if job.state not in TERMINAL
        else f"ended {job.state} at round {job.round}/{job.rounds}"
    )
    console.print(
        f"{what} of round {of_round} written to {output}; not a final model: job {job.id} {status}",
        highlight=False,
    )


def _export_hf(
    job: JobInfo, checkpoint: bytes, output: Path, base: Path | None, merge: bool, key: bytes | None
) -> str:
    """Write ``checkpoint`` as a directory transformers loads, over the job's model directory (found
    where it was submitted from, or ``base``; an encrypted job's checked with its data key ``key``);
    returns what it wrote."""
    from gpuflex.train.export import export_hf
    from gpuflex.train.pretrained import same_model

    training = job.spec.training
    if training.model.from_ is None or training.model.uploaded is None:
        raise BadRequest(
            f"job {job.id} did not fine-tune a model directory: fetch its safetensors checkpoint"
        )
    root = base or Path(training.model.from_)
    if not root.is_dir() or not same_model(root, training.model.uploaded, key):
        raise BadRequest(
            f"{root} is not the model directory job {job.id} was submitted with (its files differ, or it is "
            "not on this machine): pass it with --base"
        )
    export_hf(checkpoint, training, root, output, merge=merge)
    kind = "merged model" if merge else "LoRA adapter" if training.lora else "model"
    return f"{kind} (transformers loads it with from_pretrained)"


@job_app.command("watch")
def watch(job_id: JobId, url: Url = None, token: Token = None) -> None:
    """Follow a job live until it ends: round, losses, live workers, credits spent.

    An encrypted job's data key is served to its leased nodes meanwhile (as `job keys` does).

    Exit code: 0 completed, 3 failed, 4 cancelled, 5 out_of_budget, 130 stopped watching (Ctrl-C; the job
    goes on)."""
    client = consumer_client(url, token)
    encrypted = client.job(job_id).spec.privacy.encrypt
    _follow(client, job_id, consumer_client(url, token) if encrypted else None)


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
        f"spent {credits(job.spent)} of {credits(job.budget)} credits"
    )


def _follow(client: Client, job_id: str, keys_client: Client | None = None) -> None:
    """Watch a job to its end and exit with the code its end has (``EXIT_CODES``); with ``keys_client``,
    serve the job's data key meanwhile. Ctrl-C stops the watching, not the job: say so, and how to watch
    it again or cancel it."""
    stop_keys = None
    if keys_client is not None:  # its lines go through the watch's console, above the live view
        stop_keys = data_keys.in_background(keys_client, job_id, lambda x: console.print(x, highlight=False))
    try:
        job = watch_job(client, job_id, console)
    except KeyboardInterrupt:
        Console(stderr=True).print(
            f"stopped watching; job {job_id} goes on, and spends its budget, until it ends.\n"
            f"  watch it again: gpuflex job watch {job_id}\n"
            f"  cancel it:      gpuflex job cancel {job_id}",
            highlight=False,
        )
        raise typer.Exit(130) from None
    finally:
        if stop_keys is not None:
            stop_keys()
    _summary(job)
    raise typer.Exit(EXIT_CODES.get(job.state, 0))
