"""``gpuflex governance propose | vote | proposals | parameters``: the network's parameters, voted by stake.

``propose`` and ``vote`` act as a provider node (its key, found like ``provider dashboard`` finds
it: ``--name`` / ``--data-dir``); ``proposals`` and ``parameters`` read with a consumer's API token.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpuflex.cli.options import Token, Url
from gpuflex.cli.profile import consumer_client
from gpuflex.cli.provider import DataDir, Name, node_client
from gpuflex.protocol import messages as m

governance_app = typer.Typer(help="Propose and vote on the network's parameters.", no_args_is_help=True)
console = Console()


def _at(t: datetime) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M")


@governance_app.command("propose")
def propose(
    parameter: Annotated[str, typer.Argument(help="a parameter `gpuflex governance parameters` lists")],
    value: Annotated[float, typer.Argument(help="its new value")],
    effective_in: Annotated[
        float, typer.Option(help="hours from now until it takes effect; after voting closes", min=0)
    ],
    reason: Annotated[str, typer.Option(help="why: shown to voters and kept in the journal")],
    name: Name = None,
    data_dir: DataDir = None,
    url: Url = None,
) -> None:
    """Propose a new value for a network parameter, as your provider node (it needs stake)."""
    at = datetime.fromtimestamp(time.time() + effective_in * 3600, UTC)
    msg = m.ProposalCreate(parameter=parameter, value=value, effective_at=at, reason=reason)
    p = node_client(name, data_dir, url).propose(msg)
    console.print(
        f"proposal [bold]{p.id}[/]: {p.parameter} = {p.value}; voting closes {_at(p.closes_at)}, "
        f"in force from {_at(p.effective_at)} if it passes"
    )


@governance_app.command("vote")
def vote(
    proposal_id: Annotated[str, typer.Argument(help="id or prefix, from `gpuflex governance proposals`")],
    choice: Annotated[m.VoteChoice, typer.Argument(help="yes, no or abstain (counts toward quorum only)")],
    name: Name = None,
    data_dir: DataDir = None,
    url: Url = None,
) -> None:
    """Vote with your provider node's stake. Votes are final."""
    v = node_client(name, data_dir, url).vote(proposal_id, choice)
    console.print(f"voted {v.choice} on {v.proposal_id} with {v.weight:g} credits of stake")


@governance_app.command("proposals")
def proposals(url: Url = None, token: Token = None) -> None:
    """List proposals, newest first."""
    table = Table("id", "parameter", "value", "state", "voting closes", "in force from", "proposer", "reason")
    for p in consumer_client(url, token).proposals():
        row = (p.id, p.parameter, str(p.value), p.state, _at(p.closes_at), _at(p.effective_at))
        table.add_row(*row, p.proposer, p.reason)
    console.print(table)


@governance_app.command("parameters")
def parameters(url: Url = None, token: Token = None) -> None:
    """The governable parameters: values in force, their ranges and changes to come."""
    table = Table("parameter", "value", "set by", "range", "scheduled", "meaning")
    for p in consumer_client(url, token).parameters():
        upper = "" if p.maximum is None else f"{p.maximum:g}"
        coming = ", ".join(f"{c.value} from {_at(c.effective_at)} ({c.proposal_id})" for c in p.scheduled)
        value = f"{p.value} {p.unit}".rstrip()
        table.add_row(p.name, value, p.source, f"{p.minimum:g}..{upper}", coming or "-", p.description)
    console.print(table)
