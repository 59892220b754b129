"""``gpuflex provider wallet | stake | unstake | withdraw``: a provider node's money, acting as the node.

The node is found like ``provider dashboard`` finds it (``--name`` / ``--data-dir``); every call is
signed with its key. Each command prints the wallet after the change.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from gpuflex.cli.options import Url
from gpuflex.cli.provider import DataDir, Name, node_client
from gpuflex.protocol import messages as m

console = Console()
Amount = Annotated[float, typer.Argument(help="credits", min=0)]


def _show(w: m.NodeWallet) -> None:
    console.print(
        f"node {w.node_id}: earnings {w.earnings:.6f} · held in audit windows {w.held:.6f} · "
        f"stake {w.stake:.6f} · slashed {w.slashed:.6f} credits"
    )


def wallet(name: Name = None, data_dir: DataDir = None, url: Url = None) -> None:
    """Show the node's earnings, pay held until audit windows pass, stake, and what verdicts took."""
    _show(node_client(name, data_dir, url).wallet())


def stake(
    amount: Amount,
    from_earnings: Annotated[
        bool, typer.Option("--from-earnings", help="stake earnings instead of paying in from outside")
    ] = False,
    name: Name = None,
    data_dir: DataDir = None,
    url: Url = None,
) -> None:
    """Bond stake: the market gives community nodes work only with the network's min_stake (`gpuflex
    governance parameters` shows it; 0 unless the operator or a vote set one)."""
    _show(node_client(name, data_dir, url).stake(amount, "earnings" if from_earnings else "deposit"))


def unstake(amount: Amount, name: Name = None, data_dir: DataDir = None, url: Url = None) -> None:
    """Move stake back to earnings, once none of the node's work is under audit."""
    _show(node_client(name, data_dir, url).unstake(amount))


def withdraw(amount: Amount, name: Name = None, data_dir: DataDir = None, url: Url = None) -> None:
    """Pay earnings out of the network."""
    _show(node_client(name, data_dir, url).withdraw(amount))
