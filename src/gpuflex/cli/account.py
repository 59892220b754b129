"""``gpuflex account create | use | profiles``, ``whoami``, and ``wallet deposit | balance``."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import Json, credits, print_json, table
from gpuflex.cli.profile import Profiles, Saved, consumer_client, masked, resolve, resolve_ca, resolve_url
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.protocol import messages as m

account_app = typer.Typer(
    help="Consumer accounts and the profiles that keep their tokens.", no_args_is_help=True
)
wallet_app = typer.Typer(help="Credits (USD-pegged) in your wallet.", no_args_is_help=True)
console = Console()
DEPOSIT_RANGE = f"{credits(m.MIN_CREDITS)} to {credits(m.MAX_CREDITS)}"  # the server's own bounds
ProfileName = Annotated[str, typer.Argument(help="a profile's name, as `gpuflex account profiles` lists it")]


@account_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="account name (letters, digits, . _ @ -)")],
    url: Url = None,
    save: Annotated[bool, typer.Option(help="save URL and token as profile NAME")] = True,
    force: Annotated[
        bool, typer.Option("--force", help="replace a saved profile NAME (its token is lost)")
    ] = False,
) -> None:
    """Create an account, print its API token (shown once) and save it as profile NAME."""
    url = resolve_url(url)
    profiles = Profiles.load(unreadable_ok=force) if save else None
    if profiles is not None and not force:
        profiles.check_free(name)  # before the account exists, not after
    ca = resolve_ca(saved=False)  # a new profile's own: not another profile's
    created = Client(url, ca=ca).create_account(name)
    console.print(f"account [bold]{created.name}[/] ({created.account_id})")
    console.print(f"token: [bold]{created.token}[/]")
    if profiles is None:
        return
    profiles.add(name, Saved(url=url, token=created.token, ca=str(Path(ca).resolve()) if ca else None))
    profiles.save()
    if profiles.default == name:
        how = "the default one: commands use it unless --profile or GPUFLEX_PROFILE name another"
    else:
        how = (
            f"use it with `gpuflex --profile {name} COMMAND` (or GPUFLEX_PROFILE={name}), "
            f"or make it the default with `gpuflex account use {name}`"
        )
    console.print(f"saved as profile [bold]{name}[/] in {profiles.path}; {how}", highlight=False)


@account_app.command("use")
def use(name: ProfileName) -> None:
    """Make a saved profile the default one."""
    profiles = Profiles.load()
    profiles.use(name)
    profiles.save()
    console.print(f"default profile: [bold]{name}[/] ({profiles.saved[name].url})", highlight=False)


@account_app.command("profiles")
def list_profiles(as_json: Json = False) -> None:
    """The saved profiles, the default marked with *; tokens are shown in part only."""
    profiles = Profiles.load()
    rows = [
        {"profile": name, "default": name == profiles.default, "url": p.url, "token": masked(p.token)}
        for name, p in sorted(profiles.saved.items())
    ]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print(f"no profiles in {profiles.path}: run `gpuflex account create NAME`", highlight=False)
        return
    shown = table("", "profile", "url", "token", ids=["profile", "token"], title=str(profiles.path))
    for row in rows:
        shown.add_row("*" if row["default"] else "", row["profile"], row["url"], row["token"])
    console.print(shown)


def whoami(url: Url = None, token: Token = None) -> None:
    """Who the CLI acts as: the account, the coordinator, the profile they came from, and the balance."""
    target = resolve(url, token)
    me = target.client().me()
    profile = f"{target.profile} ({target.why})" if target.profile else "none (--token / GPUFLEX_TOKEN)"
    console.print(
        f"account: [bold]{me.name}[/] ({me.account_id})\ncoordinator: {target.url}"
        f"{f' (verified with the CA in {target.ca})' if target.ca else ''}\nprofile: {profile}\n"
        f"balance: {credits(me.balance)} credits",
        highlight=False,
    )


@wallet_app.command("deposit", context_settings={"ignore_unknown_options": True})
def deposit(
    amount: Annotated[float, typer.Argument(help=f"credits to add, {DEPOSIT_RANGE}")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Add credits to your wallet."""
    # ignore_unknown_options: "-5" reaches here as a number, to be refused in words, not as an option
    if not m.MIN_CREDITS <= amount <= m.MAX_CREDITS:
        raise BadRequest(f"a deposit must be {DEPOSIT_RANGE} credits, not {amount:.12g}")
    balance = consumer_client(url, token).deposit(amount)
    console.print(f"balance: {credits(balance.balance)} credits")


@wallet_app.command("balance")
def balance(url: Url = None, token: Token = None) -> None:
    """Show your wallet's balance."""
    console.print(f"balance: {credits(consumer_client(url, token).balance().balance)} credits")
