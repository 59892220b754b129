"""``gpuflex provider start``: offer this machine's GPU (or CPU) on the market."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer

from gpuflex.cli.profile import resolve_url

provider_app = typer.Typer(help="Offer this machine's compute.", no_args_is_help=True)


@provider_app.command("start")
def start(
    price: Annotated[float, typer.Option(help="asking price, credits per hour")] = 0.10,
    name: Annotated[str | None, typer.Option(help="node name shown on the market")] = None,
    url: Annotated[str | None, typer.Option(help="coordinator URL [env GPUFLEX_URL]")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="key and task work dirs")] = None,
    core: Annotated[
        bool, typer.Option("--core", help="register as a core node (needs the core token)")
    ] = False,
    core_token: Annotated[
        str | None, typer.Option(envvar="GPUFLEX_CORE_TOKEN", help="operator's core token")
    ] = None,
    region: Annotated[str, typer.Option(help="region label")] = "local",
    threads: Annotated[int, typer.Option(help="CPU threads a task may use; 0: all")] = 0,
    memory_mb: Annotated[int, typer.Option(help="address-space limit of a task (MB)")] = 8192,
) -> None:
    """Run the provider agent until SIGTERM / Ctrl-C; a running task is handed back on the way out."""
    from gpuflex.agent.daemon import Agent, AgentConfig
    from gpuflex.agent.sandbox import Limits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = name or socket.gethostname()
    config = AgentConfig(
        coordinator_url=resolve_url(url),
        name=name,
        data_dir=data_dir or Path.home() / ".gpuflex" / "agent" / name,
        price_per_hour=price,
        kind="core" if core else "community",
        core_token=core_token,
        region=region,
        task_threads=threads,
        limits=Limits(memory_mb=memory_mb),
    )
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.run()
