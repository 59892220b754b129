"""``gpuflex operator slash`` (the operator's token) and ``gpuflex slashes`` (anyone): verdicts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import typer
from rich.console import Console

from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import Json, credits, print_json, table
from gpuflex.cli.profile import public_client, resolve_ca, resolve_url
from gpuflex.client import Client
from gpuflex.errors import Unauthorized
from gpuflex.protocol import messages as m

operator_app = typer.Typer(help="The operator's verdicts.", no_args_is_help=True)
console = Console()


@operator_app.command("slash")
def slash(
    node_id: Annotated[str, typer.Argument(help="node id or a unique prefix, from `gpuflex offers`")],
    amount: Annotated[float, typer.Argument(help="credits of stake to take", min=0)],
    evidence: Annotated[str, typer.Option(help="what the node did and how it was found: kept for all")],
    job: Annotated[str | None, typer.Option(help="also withhold the node's held pay for this job")] = None,
    operator_token: Annotated[
        str | None,
        typer.Option(
            envvar="GPUFLEX_OPERATOR_TOKEN",
            help="the coordinator's operator token (kept in its data_dir/operator_token)",
        ),
    ] = None,
    url: Url = None,
) -> None:
    """Take a node's stake for a verdict (and with --job, its pay held for that job)."""
    if not operator_token:
        raise Unauthorized("slashing needs the operator token: --operator-token or GPUFLEX_OPERATOR_TOKEN")
    record = Client(resolve_url(url), operator_token, ca=resolve_ca()).slash(
        m.SlashRequest(node_id=node_id, amount=amount, evidence=evidence, job_id=job)
    )
    withheld = f", {record.withheld:.6f} of held pay refunded to its owner" if record.job_id else ""
    console.print(f"slashed {record.node_id}: {record.amount:.6f} credits of stake taken{withheld}")


def slashes(json: Json = False, url: Url = None, token: Token = None) -> None:
    """Every verdict's penalty: who was slashed, how much, and the evidence. Public: no token needed."""
    listed = public_client(url, token).slashes()
    if json:
        print_json(listed)
        return
    out = table("when", "node", "job", "taken", "evidence", ids=["node", "job"])
    for s in listed:
        at = datetime.fromtimestamp(s.at).strftime("%Y-%m-%d %H:%M")
        taken = f"{credits(s.amount)} of stake" + (f", {credits(s.withheld)} of held pay" if s.job_id else "")
        out.add_row(at, s.node_id, s.job_id or "-", taken, s.evidence)
    console.print(out)
