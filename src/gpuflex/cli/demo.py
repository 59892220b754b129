"""``gpuflex demo``: a whole network on this machine trains a small GPT, then shows the money.

One coordinator (SQLite under the demo's data directory), one core node and three community
providers as separate processes; the built-in job (``examples/char-gpt.yaml``) trains a
character-level GPT on the standard library's source across 3 workers.
"""

from __future__ import annotations

import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpuflex.cli.jobs import upload_inputs
from gpuflex.cli.watch import watch_job
from gpuflex.client import Client
from gpuflex.errors import BadRequest, GPUFlexError, ServiceError
from gpuflex.ledger.export import verify_export
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.messages import Quote
from gpuflex.protocol.spec import JobSpec, job_spec_from_yaml

console = Console()
PROVIDERS = [
    ("core-1", 0.40, True),
    ("community-1", 0.10, False),
    ("community-2", 0.12, False),
    ("community-3", 0.15, False),
]


MARKER = ".gpuflex-demo"  # marks a directory the demo made, so it only ever wipes its own


def fresh_demo_dir(data_dir: Path) -> None:
    """Empty the demo's directory from a previous run; refuse to touch any other directory."""
    if data_dir.exists() and any(data_dir.iterdir()):
        if not (data_dir / MARKER).exists():
            raise BadRequest(
                f"{data_dir} is not empty and was not made by `gpuflex demo`: choose another --data-dir"
            )
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / MARKER).touch()


def builtin_spec() -> JobSpec:
    return job_spec_from_yaml(resources.files("gpuflex.examples").joinpath("char-gpt.yaml").read_text())


def _wait_for_nodes(client: Client, count: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(o.state == "online" for o in client.offers()) < count:
        if time.monotonic() > deadline:
            raise ServiceError(f"fewer than {count} providers registered within {timeout_s:.0f}s")
        time.sleep(0.5)


def demo(
    data_dir: Annotated[Path, typer.Option(help="where the demo keeps its database, blobs and logs")] = Path(
        "gpuflex-demo"
    ),
    rounds: Annotated[int | None, typer.Option(help="override the job's rounds")] = None,
) -> None:
    """Start a local network, train the built-in job on it, print results, and stop everything."""
    fresh_demo_dir(data_dir)
    spec = builtin_spec()
    if rounds is not None:
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"rounds": rounds})})
    started = time.monotonic()
    with LocalNetwork(data_dir) as net:
        url = net.start_coordinator()
        console.print(f"coordinator: {url} (SQLite in {data_dir / 'coordinator'})")
        client = Client(url, Client(url).create_account("demo").token)
        client.deposit(10)
        for count, (name, price, core) in enumerate(PROVIDERS, 1):
            net.start_agent(name, price=price, core=core, extra=["--core-token", CORE_TOKEN] if core else [])
            # one at a time: on one machine, benchmarks run side by side would score each other
            _wait_for_nodes(client, count)
        console.print(
            f"{len(PROVIDERS)} providers online (1 core, {len(PROVIDERS) - 1} community); "
            f"logs in {data_dir / 'logs'}"
        )
        quote = client.quote(spec)
        if quote.placeable:
            console.print(
                f"quote: ≈ {quote.cost:.6f} credits ({quote.cost_low:.6f}–{quote.cost_high:.6f}), "
                f"≈ {quote.duration_s:.0f}s ({quote.duration_low_s:.0f}–{quote.duration_high_s:.0f}s); "
                "nothing spent yet",
                highlight=False,
            )
        job = client.submit(spec, **upload_inputs(client, spec))
        console.print(
            f"job {job.id}: {spec.resources.workers} workers x {spec.training.rounds} rounds x "
            f"{spec.training.inner_steps} inner steps, {spec.training.compression.label} compression"
        )
        final = watch_job(client, job.id, console, timeout_s=600)
        if final.state != "completed":
            raise GPUFlexError(
                f"job {job.id} ended {final.state}: {final.reason}\n{_last_events(client, job.id)}"
            )
        _report(client, job.id, data_dir, time.monotonic() - started, quote)


def _last_events(client: Client, job_id: str) -> str:
    return "\n".join(e.message for e in client.logs(job_id)[-8:])


def _report(client: Client, job_id: str, data_dir: Path, elapsed_s: float, quote: Quote) -> None:
    job = client.job(job_id)
    checkpoint = data_dir / "checkpoint.safetensors"
    checkpoint.write_bytes(client.checkpoint(job_id))
    console.print(
        f"validation loss: {job.initial_val_loss:.4f} before -> {job.val_loss:.4f} after {job.round} rounds"
    )
    console.print(f"checkpoint: {checkpoint} (safetensors, sha256 {job.checkpoint[:16]}...)")
    table = Table("provider", "kind", "seconds", "credits", title="cost per provider")
    for c in job.costs:
        table.add_row(c.name, c.kind, f"{c.seconds:.1f}", f"{c.cost:.6f}")
    total = sum(c.cost for c in job.costs)
    table.add_row("total", "", "", f"{total:.6f}")
    console.print(table)
    if quote.placeable:
        ran_s = max(c.seconds for c in job.costs)
        console.print(
            f"actual: {total:.6f} credits over {ran_s:.0f}s of leases "
            f"(quoted ≈ {quote.cost:.6f} credits, ≈ {quote.duration_s:.0f}s)",
            highlight=False,
        )
    console.print(f"wallet: {client.balance().balance:.6f} credits (10 deposited, unspent budget refunded)")
    report = verify_export(client.ledger())
    if not report.ok:
        raise GPUFlexError(f"ledger: chain BROKEN: {report.problem}")
    console.print(f"ledger: {report.entries} entries, chain verified")
    console.print(f"demo finished in {elapsed_s:.0f}s; stopping the network")
