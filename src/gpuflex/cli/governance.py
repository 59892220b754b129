"""``gpuflex governance propose | vote | proposals | parameters``: the network's parameters, voted by stake.

``propose`` and ``vote`` act as a provider node (its key, found like ``provider dashboard`` finds
it: ``--name`` / ``--data-dir``); ``proposals`` and ``parameters`` are public: no token needed.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console

from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import Json, print_json, table
from gpuflex.cli.profile import public_client
from gpuflex.cli.provider import DataDir, Name, node_client
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol import messages as m

_DEFAULT = {name: field.default for name, field in CoordinatorSettings.model_fields.items()}
VOTING_HOURS = _DEFAULT["governance_voting_period_s"] / 3600
# The rules as a coordinator applies them by default, read from its settings so they cannot drift.
RULES = (
    "The rules, as a coordinator sets them by default (its operator may change them): a node needs "
    f"{_DEFAULT['governance_proposal_stake']:g} credits of stake to propose "
    f"(GPUFLEX_GOVERNANCE_PROPOSAL_STAKE). Voting stays open {VOTING_HOURS:g} h "
    "(GPUFLEX_GOVERNANCE_VOTING_PERIOD_S); staked nodes vote yes, no or abstain, each weighing the stake it "
    "has when it votes, and votes are final. When voting closes, a proposal passes if the stake that voted "
    f"is at least {_DEFAULT['governance_quorum']:.0%} of all stake (the quorum, GPUFLEX_GOVERNANCE_QUORUM) "
    "and more of it voted yes than no (abstain counts toward the quorum only). A passed value takes effect "
    "at the time the proposal set, which must fall after voting closes. Every proposal, vote and tally is "
    "a journal entry."
)
governance_app = typer.Typer(
    help=f"Propose and vote on the network's parameters, weighed by stake.\n\n{RULES}", no_args_is_help=True
)
console = Console()


def _at(t: datetime) -> str:
    return t.astimezone().strftime("%Y-%m-%d %H:%M")


@governance_app.command(
    "propose",
    help=f"Propose a new value for a network parameter, as your provider node (it needs stake).\n\n{RULES}",
)
def propose(
    parameter: Annotated[str, typer.Argument(help="a parameter `gpuflex governance parameters` lists")],
    value: Annotated[float, typer.Argument(help="its new value")],
    effective_in: Annotated[
        float,
        typer.Option(
            help=f"hours from now until it takes effect; after voting closes ({VOTING_HOURS:g} h by default)",
            min=0,
        ),
    ],
    reason: Annotated[str, typer.Option(help="why: shown to voters and kept in the journal")],
    name: Name = None,
    data_dir: DataDir = None,
    url: Url = None,
) -> None:
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
def proposals(json: Json = False, url: Url = None, token: Token = None) -> None:
    """List proposals, newest first. Public: no token needed."""
    listed = public_client(url, token).proposals()
    if json:
        print_json(listed)
        return
    out = table("id / by", "change", "state", "reason", ids=["id / by"])
    for p in listed:
        out.add_row(f"{p.id}\n{p.proposer}", f"{p.parameter} = {p.value}", _state(p), p.reason)
    console.print(out)


def _state(p: m.ProposalInfo) -> str:
    closes, effective = _at(p.closes_at), _at(p.effective_at)
    if p.state == "open":
        return f"open until {closes}; in force from {effective} if it passes"
    return f"{p.state} at {closes}" + (f"; in force from {effective}" if p.state == "passed" else "")


@governance_app.command("parameters")
def parameters(json: Json = False, url: Url = None, token: Token = None) -> None:
    """The governable parameters: values in force, ranges, changes to come. Public: no token needed."""
    listed = public_client(url, token).parameters()
    if json:
        print_json(listed)
        return
    out = table("parameter", "value", "range", "meaning", ids=["parameter"])
    for p in listed:
        upper = "" if p.maximum is None else f"{p.maximum:g}"
        source = "the coordinator's setting" if p.source == "setting" else f"voted in {p.source}"
        value = f"{p.value} {p.unit}".rstrip() + f", {source}"
        coming = [f"; {c.value} from {_at(c.effective_at)} ({c.proposal_id})" for c in p.scheduled]
        out.add_row(p.name, value + "".join(coming), f"{p.minimum:g}..{upper}", p.description)
    console.print(out)
