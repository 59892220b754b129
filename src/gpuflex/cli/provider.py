"""``gpuflex provider start``: offer this machine's GPU (or CPU) on the market; ``provider dashboard``.

``node_key`` / ``node_client`` find a provider's key for every command that acts as the node
(``provider wallet``, ``governance propose``...).
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Annotated

import typer

from gpuflex.auth.signing import NodeKey
from gpuflex.cli.profile import resolve_ca, resolve_url
from gpuflex.client import NodeClient
from gpuflex.errors import BadRequest, NotFound
from gpuflex.jsonlog import LogFormat

provider_app = typer.Typer(help="Offer this machine's compute.", no_args_is_help=True)

Name = Annotated[str | None, typer.Option(help="node name shown on the market \\[default: host name]")]
DataDir = Annotated[
    Path | None, typer.Option(help="key and task work dirs \\[default: ~/.gpuflex/agent/NAME]")
]


def _data_dir(data_dir: Path | None, name: str) -> Path:
    return data_dir or Path.home() / ".gpuflex" / "agent" / name


def node_key(name: str | None, data_dir: Path | None) -> NodeKey:
    """The key of the provider started with this ``--name`` / ``--data-dir``, for commands that act as it."""
    key_file = _data_dir(data_dir, name or socket.gethostname()) / "node.key"
    if not key_file.exists():
        raise NotFound(f"no node key at {key_file}: pass the --data-dir the provider runs with")
    return NodeKey.load_or_create(key_file)


def node_client(name: str | None, data_dir: Path | None, url: str | None) -> NodeClient:
    """A client that acts as that provider: each request signed with its key."""
    return NodeClient(resolve_url(url), node_key(name, data_dir), ca=resolve_ca())


@provider_app.command("start")
def start(
    price: Annotated[float, typer.Option(help="asking price, credits per hour")] = 0.10,
    name: Name = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="coordinator URL \\[env GPUFLEX_URL]; several processes of one network comma-separated "
            "(http://a:8750,http://b:8750): the agent and its tasks go to the next when one cannot be reached"
        ),
    ] = None,
    data_dir: DataDir = None,
    core: Annotated[
        bool, typer.Option("--core", help="register as a core node (needs the core token)")
    ] = False,
    core_token: Annotated[
        str | None, typer.Option(envvar="GPUFLEX_CORE_TOKEN", help="operator's core token")
    ] = None,
    region: Annotated[str, typer.Option(help="region label")] = "local",
    available_hours: Annotated[
        float | None,
        typer.Option(
            min=0,
            max=87_600,
            help="stay on offer this many hours, then take no new task \\[default: open-ended]",
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="CPU threads a task may use; 0: all")] = 0,
    memory_mb: Annotated[int, typer.Option(help="address-space limit of a task (MB)")] = 8192,
    cache_gb: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="disk for the shard cache (DATA_DIR/cache): dataset shards and model files, kept by hash",
        ),
    ] = 20.0,
    emulate_step_s: Annotated[
        float,
        typer.Option(
            min=0, help="pad each training step to at least this long: emulate a slower device (benchmarks)"
        ),
    ] = 0.0,
    log_format: Annotated[
        LogFormat, typer.Option(envvar="GPUFLEX_LOG_FORMAT", help="text, or json (one object per line)")
    ] = "text",
    private_data: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=DIR: offer DIR (a `gpuflex data prepare` output) to federated jobs as NAME; its data "
            "never leaves this machine, only NAME, its size and its manifest hash are announced (repeatable)"
        ),
    ] = None,
    allow_consumer: Annotated[
        list[str] | None,
        typer.Option(
            help="an account whose federated jobs may train on this node's private data (repeatable)"
        ),
    ] = None,
    adversary: Annotated[
        str | None,
        typer.Option(
            help="TESTING ONLY: cheat — every worker task plays this gpuflex.train.adversaries kind "
            "(e.g. scaled), or every server task this gpuflex.serve.cheats kind (serve-smaller, serve-int8, "
            "serve-int4); verification should slash this node and bar it from the job or deployment"
        ),
    ] = None,
) -> None:
    """Run the provider agent until SIGTERM / Ctrl-C; a running task is handed back on the way out."""
    from gpuflex import jsonlog
    from gpuflex.agent.daemon import Agent, AgentConfig
    from gpuflex.agent.private import parse_private_data
    from gpuflex.agent.sandbox import Limits

    if adversary is not None:
        from gpuflex.serve.cheats import SERVING
        from gpuflex.train.adversaries import KINDS

        if adversary not in KINDS.keys() | SERVING.keys():
            raise BadRequest(f"unknown adversary {adversary!r}: one of {', '.join([*KINDS, *SERVING])}")
    name = name or socket.gethostname()
    config = AgentConfig(
        coordinator_url=resolve_url(url),
        ca=resolve_ca(),
        name=name,
        data_dir=_data_dir(data_dir, name),
        price_per_hour=price,
        kind="core" if core else "community",
        core_token=core_token,
        region=region,
        available_hours=available_hours,
        task_threads=threads,
        emulate_step_s=emulate_step_s,
        limits=Limits(memory_mb=memory_mb),
        cache_gb=cache_gb,
        adversary=adversary,
        private_data=parse_private_data(private_data or []),
        consumers=tuple(allow_consumer or []),
    )
    agent = Agent(config)
    jsonlog.configure(log_format, node_id=agent.key.node_id)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.run()


@provider_app.command("dashboard")
def dashboard(
    name: Name = None,
    data_dir: DataDir = None,
    url: Annotated[str | None, typer.Option(help="coordinator URL \\[env GPUFLEX_URL]")] = None,
) -> None:
    """Print a short-lived link that signs this node in to its earnings page on the dashboard."""
    from gpuflex.client.http import HttpSession

    base = resolve_url(url).rstrip("/")
    session = HttpSession(base, sign=node_key(name, data_dir).sign_request, ca=resolve_ca())
    try:
        link = session.request("POST", "/v1/nodes/dashboard-token").json()
    finally:
        session.close()
    minutes = max(1, round((link["expires_at"] - time.time()) / 60))
    typer.echo(f"{base}{link['path']}")
    typer.echo(f"(open it within {minutes} min; it signs you in as this node)", err=True)
