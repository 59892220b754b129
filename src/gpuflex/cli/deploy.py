"""Deployment commands: ``gpuflex deploy``, ``deployments``, ``chat``, and the ``deployment`` group
(``show | logs | scale | stop | key create | key claim``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from gpuflex.cli.inputs import upload_model
from gpuflex.cli.jobs import print_events, verdict_table
from gpuflex.cli.options import Dtype, Token, Url
from gpuflex.cli.output import Json, at_least, credits, print_json, settled, table
from gpuflex.cli.profile import consumer_client, resolve
from gpuflex.cli.watch import TERMINAL
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.market.memory import serve_vram_estimate_gb, serve_ways_to_fit
from gpuflex.protocol.deployment import DeployedModel, DeploymentSpec
from gpuflex.protocol.messages import DeploymentInfo, DeploymentKeyCreated, KeyUsage, Offer
from gpuflex.protocol.spec import JobSpec, ModelSize, describe_validation_error

deployment_app = typer.Typer(help="Follow and manage one deployment.", no_args_is_help=True)
key_app = typer.Typer(help="API keys scoped to one deployment.", no_args_is_help=True)
deployment_app.add_typer(key_app, name="key")
console = Console()
DeploymentId = Annotated[
    str, typer.Argument(help="deployment name or id as `gpuflex deployments` lists them, or an id's prefix")
]


def upload_served_model(client: Client, directory: Path) -> DeployedModel:
    """A ``save_pretrained`` directory, checked, sized and uploaded as a job's ``model.from`` is (what the
    blob store holds already is not sent again)."""
    model = upload_model(client, _as_job(directory)).training.model
    return DeployedModel(from_=model.from_, uploaded=model.uploaded, size=model.size)


def _as_job(directory: Path) -> JobSpec:
    """A job on ``directory``: what checks, sizes and uploads a model directory does it for a deployment."""
    return JobSpec.model_validate(
        {"name": "deploy", "training": {"recipe": "hf-causal-lm", "model": {"from": str(directory)}}}
    )


def _size(directory: Path) -> ModelSize:
    """A model directory's size, counted on the meta device (nothing read but its config)."""
    from gpuflex.train.pretrained import sized  # transformers: only when a directory is deployed

    size = sized(_as_job(directory).training).model.size
    assert size is not None, "sized counts a model directory"
    return size


def _check_directory(model: Path) -> None:
    if not model.is_dir():
        raise BadRequest(f"--model {model}: no such directory")
    from gpuflex.train.export import is_adapter  # torch: only when a directory is deployed

    is_adapter(model)


def _spec(fields: dict[str, object], name: str, served: DeployedModel) -> DeploymentSpec:
    """The deployment of ``served`` named ``name`` with the command's ``fields``, checked as the
    coordinator checks it (one line naming the field, for an invalid one)."""
    try:
        return DeploymentSpec.model_validate(
            {"name": name, "model": served.model_dump(exclude_none=True), **fields}
        )
    except ValidationError as err:
        raise BadRequest(f"invalid deployment: {describe_validation_error(err, DeploymentSpec)}") from None


def _check_fits(
    online: list[Offer], size: ModelSize | None, context: int, max_batch: int, dtype: str
) -> None:
    """Refuse, in one line with what would fit, a replica no online GPU node can hold by the market's
    estimate (a CPU node, which serves from its RAM, is not held to it; with none of either, it waits)."""
    gpus = [o for o in online if o.vram_gb > 0]
    if size is None or not gpus:
        return
    need = serve_vram_estimate_gb(size, context, max_batch, dtype)
    largest = max(o.vram_gb for o in gpus)
    if need <= largest:
        return
    ways = serve_ways_to_fit(size, context, max_batch, dtype, largest)
    fits = f"it would fit with {'; or '.join(ways)}" if ways else "no --dtype or --context makes it fit"
    raise BadRequest(
        f"no online node can hold this deployment's replicas: a replica needs ≈ {need:g} GB of VRAM by the "
        f"market's estimate; the largest online GPU has {largest:g} GB: {fits}"
    )


def _check_budget(online: list[Offer], replicas: int, max_price: float, budget: float) -> None:
    """Refuse a budget that cannot pay the first minute of the replicas on the cheapest ``online`` nodes
    they may take (it would end out of budget while the model loads, having served nothing), and warn of
    one that lasts under an hour; with no such node online it waits, spending nothing."""
    prices = [o.price_per_hour for o in online if o.price_per_hour <= max_price]
    per_hour = sum(sorted(prices)[:replicas])
    if not per_hour:
        return
    lasts_s = budget / per_hour * 3600
    at = f"{min(replicas, len(prices))} replicas at the cheapest online prices, {credits(per_hour)} credits/h"
    if lasts_s < 60:
        raise BadRequest(
            f"a budget of {credits(budget)} credits pays ≈ {lasts_s:.0f} s of {at}, not their first minute: "
            f"give --budget {at_least(per_hour / 60)} or more"
        )
    if lasts_s < 3600:
        console.print(f"the budget lasts ≈ {lasts_s / 60:.0f} min of {at}", style="yellow", highlight=False)


def deploy(
    job_id: Annotated[
        str | None, typer.Argument(help="serve this training job's newest checkpoint (id or prefix)")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="serve this save_pretrained directory instead, or a LoRA adapter over one (merged into it)",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="a name for it; default: the job's or directory's")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="replicas on as many nodes")] = 1,
    max_price: Annotated[float, typer.Option(help="the most a replica's node may ask, credits/h")] = 1.0,
    budget: Annotated[float, typer.Option(help="credits moved into escrow; it ends when spent")] = 5.0,
    context: Annotated[int, typer.Option(help="longest prompt plus completion, in tokens")] = 2048,
    audit_rate: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="share of served requests a core node re-checks against the replica's fingerprints; "
            "a replica caught serving another model is slashed, barred and replaced",
        ),
    ] = DeploymentSpec.model_fields["audit_rate"].default,
    dtype: Dtype = DeploymentSpec.model_fields["dtype"].default,
    wait: Annotated[
        bool, typer.Option("--wait", help="return once a replica answers (exit 1 if it ends before)")
    ] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Serve a model on the network: a training job's checkpoint, or a model directory (--model). The
    budget moves into escrow; providers are paid per second their replicas hold a lease. It is
    `starting` until a replica has loaded the model and answers, then `running`."""
    if (job_id is None) == (model is None):
        raise BadRequest("name a job to serve, or give --model DIR: one of the two")
    if model is not None:  # what the user typed is checked before the network
        _check_directory(model)
    client = consumer_client(url, token)
    online = [o for o in client.offers() if o.state == "online"]  # what the checks before any upload read
    _check_budget(online, replicas, max_price, budget)
    max_batch = DeploymentSpec.model_fields["max_batch"].default
    fields = {
        "replicas": replicas,
        "max_price_per_hour": max_price,
        "budget": budget,
        "context": context,
        "audit_rate": audit_rate,
        "dtype": dtype,
    }
    if job_id is not None:  # named after the job, never after the prefix it was given by
        job = client.job(job_id)
        _check_fits(online, job.spec.training.model.size, context, max_batch, dtype)
        d = client.deploy(_spec(fields, name or job.name, DeployedModel(job=job_id)))
    else:
        from gpuflex.train.export import whole_model  # torch, transformers: only when a directory is deployed

        with whole_model(model) as directory:  # a LoRA adapter merged into its base first
            size = _size(directory)
            _check_fits(online, size, context, max_batch, dtype)
            sized = DeployedModel(from_=str(directory), size=size)
            spec = _spec(fields, name or model.expanduser().resolve().name, sized)
            client.check_deploy(spec)  # what the coordinator would refuse, before the model goes up
            served = upload_served_model(client, directory)
        d = client.deploy(spec.model_copy(update={"model": served}))
    console.print(
        f"deployed [bold]{d.id}[/] ({d.name}): {d.model}, {d.replicas} replicas; "
        f"budget {credits(d.budget)} credits in escrow"
    )
    console.print(f"`gpuflex deployment show {d.id}` says where each replica runs, or why it waits")
    if wait:
        _wait_until_answering(client, d.id)


def _wait_until_answering(client: Client, deployment_id: str, poll_s: float = 0.5) -> None:
    """Until a replica of the deployment answers requests, saying what its replicas do meanwhile; an
    error if it ends first. A script that waits on this can send requests at once."""
    said = ""
    while (d := client.deployment(deployment_id)).state not in TERMINAL and not d.live_replicas:
        if (line := f"{d.state}: {d.reason}" if d.reason else d.state) != said:
            console.print(line, highlight=False)
            said = line
        time.sleep(poll_s)
    if not d.live_replicas:
        raise BadRequest(f"deployment {d.id} ended before a replica answered: {d.state}: {d.reason}")
    console.print(f"deployment {d.id} answers: {d.live_replicas} of {d.replicas} replicas live")


def list_deployments(as_json: Json = False, url: Url = None, token: Token = None) -> None:
    """List your deployments."""
    found = consumer_client(url, token).deployments()
    if as_json:
        print_json(found)
        return
    columns = ("id", "name", "state", "replicas", "req/s", "tok/s", "ttft ms p50/p99", "spent", "budget")
    listed = table(*columns, ids=["id"], drop=["ttft ms p50/p99", "tok/s", "req/s"])
    for d in found:
        replicas = f"{d.live_replicas}/{d.replicas}"
        listed.add_row(d.id, d.name, d.state, replicas, *_served(d), credits(d.spent), credits(d.budget))
    console.print(listed)
    console.print("[dim]served over the last minute, as the coordinator answering saw it[/]")


def _served(d: DeploymentInfo) -> tuple[str, str, str]:
    """Requests and tokens per second, and the time to first token, or dashes with nothing served."""
    if d.requests_per_s is None:
        return "-", "-", "-"
    return f"{d.requests_per_s:.2f}", f"{d.tokens_per_s:.1f}", f"{d.ttft_p50_ms:.0f}/{d.ttft_p99_ms:.0f}"


@deployment_app.command("show")
def show(deployment_id: DeploymentId, as_json: Json = False, url: Url = None, token: Token = None) -> None:
    """A deployment's state, its replicas (and why each node was chosen, or why one waits), costs, keys,
    and its inference audits: how many passed or failed, and the verdicts on the providers that failed."""
    d = consumer_client(url, token).deployment(deployment_id)
    if as_json:
        print_json(d)
        return
    console.print(
        f"[bold]{d.name}[/] ({d.id}): {d.state}{': ' + d.reason if d.reason else ''}; serves {d.model}; "
        f"{d.live_replicas} of {d.replicas} replicas live; spent {credits(d.spent)} of {credits(d.budget)}",
        highlight=False,
    )
    if d.requests_per_s is not None:
        rate, tokens, ttft = _served(d)
        console.print(f"last minute: {rate} req/s, {tokens} tok/s, time to first token {ttft} ms (p50/p99)")
    tasks = table("task", "replica", "state", "node", "epoch", ids=["task", "node"], title="replicas")
    for t in d.tasks:
        tasks.add_row(t.id, str(t.index), t.state, t.node_id or "-", str(t.epoch))
    console.print(tasks)
    for t in d.tasks:
        if t.placement:
            console.print(f"replica {t.index}: {t.placement}", markup=False, highlight=False)
    costs = table("node", "name", "kind", "seconds", "credits", ids=["node"], title="cost")
    for c in d.costs:
        costs.add_row(c.node_id, c.name, c.kind, f"{c.seconds:.1f}", f"{c.cost:.6f}")
    console.print(costs)
    columns = ("key", "holder", "requests", "tokens in", "tokens out", "price in/out", "accrued", "settled")
    title = "API keys (prices: credits per 1M tokens)"
    keys = table(*columns, ids=["key"], drop=["settled", "price in/out"], title=title)
    for k in d.keys:
        price = f"{k.price_in:g}/{k.price_out:g}"
        usage = (str(k.requests), str(k.prompt_tokens), str(k.completion_tokens))
        keys.add_row(_key_label(k), k.holder, *usage, price, credits(k.accrued), credits(k.settled))
    console.print(keys)
    a = d.audits
    console.print(
        f"inference audits (audit_rate {d.spec.audit_rate:g}): {a.passed} passed, {a.failed} failed, "
        f"{a.pending} pending"
        + (f", {a.referee} failed by a community auditor (a core node referees)" if a.referee else ""),
        highlight=False,
    )
    if d.verdicts:
        console.print(verdict_table(d.verdicts, "audit"))


def _key_label(k: KeyUsage) -> str:
    if k.account_token:
        return f"{k.id} (account token)"
    return k.id if k.claimed else f"{k.id} (unclaimed)"


@deployment_app.command("logs")
def logs(deployment_id: DeploymentId, url: Url = None, token: Token = None) -> None:
    """A deployment's log: where each replica was placed (or why it waits), leases, scaling, its end."""
    print_events(consumer_client(url, token).deployment_logs(deployment_id))


@deployment_app.command("scale")
def scale(
    deployment_id: DeploymentId,
    replicas: Annotated[int, typer.Argument(min=1, help="replicas to run from now on")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Run this many replicas: new ones are placed by the market, the newest beyond it stop."""
    d = consumer_client(url, token).scale(deployment_id, replicas)
    console.print(f"deployment {d.id}: {d.replicas} replicas asked for, {d.live_replicas} live now")


@deployment_app.command("stop")
def stop(deployment_id: DeploymentId, url: Url = None, token: Token = None) -> None:
    """Stop a deployment: providers are paid for the time served, the rest is refunded."""
    d = consumer_client(url, token).stop_deployment(deployment_id)
    console.print(settled(f"deployment {d.id}", "stopped", d.spent, d.budget))


@key_app.command("create")
def create_key(
    deployment_id: DeploymentId,
    holder: Annotated[
        str | None,
        typer.Option("--for", help="the account (its name) that holds the key and pays its prices"),
    ] = None,
    price_in: Annotated[float, typer.Option(min=0, help="credits per 1M input tokens, paid to you")] = 0.0,
    price_out: Annotated[float, typer.Option(min=0, help="credits per 1M output tokens, paid to you")] = 0.0,
    url: Url = None,
    token: Token = None,
) -> None:
    """An API key that reaches this deployment only: give it to an application (the openai client's
    api_key, with base_url the coordinator's /v1). Shown this once. Made for another account (--for), it
    pays you its prices per token, settled into the ledger in batches, and only it sees the secret
    (`gpuflex deployment key claim KEY_ID`, signed in as that account)."""
    target = resolve(url, token)
    k = target.client().create_key(deployment_id, holder, price_in, price_out)
    if k.key is None:
        pays = f"pays you {k.price_in:g}/{k.price_out:g} credits per 1M input/output tokens"
        console.print(
            f"API key {k.id} of deployment {k.deployment_id} made for {k.holder}, who "
            f"{pays if k.price_in or k.price_out else 'uses it free'}; "
            f"{k.holder} gets its secret with `gpuflex deployment key claim {k.id}`",
            highlight=False,
        )
        return
    _print_key(k, target.url)


@key_app.command("claim")
def claim_key(
    key_id: Annotated[str, typer.Argument(help="the key's id, as its deployment's owner told you")],
    url: Url = None,
    token: Token = None,
) -> None:
    """The secret of an API key another account's deployment made for you; you pay its prices per token.
    Shown this once."""
    target = resolve(url, token)
    k = target.client().claim_key(key_id)
    _print_key(k, target.url)
    if k.price_in or k.price_out:
        console.print(
            f"you pay {k.price_in:g}/{k.price_out:g} credits per 1M input/output tokens from your wallet",
            highlight=False,
        )


def _print_key(k: DeploymentKeyCreated, url: str) -> None:
    console.print(f"API key {k.id} of deployment {k.deployment_id} (shown once, store it):", highlight=False)
    typer.echo(k.key)
    console.print(
        f'OpenAI(base_url="{url.rstrip("/")}/v1", api_key=KEY) with model="{k.deployment_id}"',
        highlight=False,
    )


def chat(
    deployment_id: DeploymentId,
    system: Annotated[str | None, typer.Option(help="a system message to begin with")] = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """Chat with a deployment in the terminal, its answers streamed (the openai package, through the
    coordinator's gateway, with your account token). An empty line or Ctrl-D ends it."""
    import httpx
    from openai import OpenAI, OpenAIError

    from gpuflex.client.http import trusting

    target = resolve(url, token)
    client = OpenAI(
        base_url=f"{target.url.rstrip('/')}/v1",
        api_key=target.token or "none",
        max_retries=0,
        http_client=httpx.Client(verify=trusting(target.ca)),  # the coordinator's CA, as the CLI's own
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    try:
        client.models.retrieve(deployment_id)  # one that is not there fails now, not after a first message
        while True:
            try:
                line = console.input("[bold]you>[/] ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            answer = []
            stream = client.chat.completions.create(model=deployment_id, messages=messages, stream=True)
            for chunk in stream:
                if chunk.choices and (text := chunk.choices[0].delta.content):
                    answer.append(text)
                    console.print(text, end="", markup=False, highlight=False)
            console.print()
            messages.append({"role": "assistant", "content": "".join(answer)})
    except OpenAIError as err:
        raise BadRequest(f"the gateway refused: {err}") from None
