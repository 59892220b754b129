"""``gpuflex account create`` and ``gpuflex wallet deposit | balance``."""

from typing import Annotated

import typer
from rich.console import Console

from gpuflex.cli.options import Token, Url
from gpuflex.cli.profile import consumer_client, resolve_url, save_profile
from gpuflex.client import Client

account_app = typer.Typer(help="Consumer accounts.", no_args_is_help=True)
wallet_app = typer.Typer(help="Credits (USD-pegged) in your wallet.", no_args_is_help=True)
console = Console()


@account_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="account name (letters, digits, . _ @ -)")],
    url: Url = None,
    save: Annotated[bool, typer.Option(help="save URL and token to the profile file")] = True,
) -> None:
    """Create an account and print its API token (shown once)."""
    url = resolve_url(url)
    created = Client(url).create_account(name)
    console.print(f"account [bold]{created.name}[/] ({created.account_id})")
    console.print(f"token: [bold]{created.token}[/]")
    if save:
        console.print(f"saved to {save_profile(url, created.token)}")


@wallet_app.command("deposit")
def deposit(
    amount: Annotated[float, typer.Argument(help="credits to add")], url: Url = None, token: Token = None
) -> None:
    """Add credits to your wallet."""
    balance = consumer_client(url, token).deposit(amount)
    console.print(f"balance: {balance.balance:.6f} credits")


@wallet_app.command("balance")
def balance(url: Url = None, token: Token = None) -> None:
    """Show your wallet's balance."""
    console.print(f"balance: {consumer_client(url, token).balance().balance:.6f} credits")
