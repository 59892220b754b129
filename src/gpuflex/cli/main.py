"""The ``gpuflex`` app: command groups, and errors as one clear line with a non-zero exit."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from gpuflex.cli import (
    account,
    coordinator,
    data,
    demo,
    deploy,
    governance,
    jobs,
    ledger,
    node_wallet,
    offers,
    operator,
    profile,
    provider,
    serve,
    sim,
    train,
)
from gpuflex.cli.options import Ca, Profile
from gpuflex.errors import GPUFlexError

app = typer.Typer(
    name="gpuflex",
    help="GPUFlex: train models on many unreliable, heterogeneous GPUs with DiLoCo-style rounds.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _options(profile_name: Profile = None, ca: Ca = None) -> None:
    """Options of ``gpuflex`` itself, before the command: ``--profile`` picks a saved profile, ``--ca``
    the CA that signed an HTTPS coordinator's certificate."""
    profile.choose(profile_name, ca)


app.command("demo")(demo.demo)
app.add_typer(coordinator.coordinator_app, name="coordinator")
for command in (node_wallet.wallet, node_wallet.stake, node_wallet.unstake, node_wallet.withdraw):
    provider.provider_app.command()(command)
app.add_typer(provider.provider_app, name="provider")
app.add_typer(account.account_app, name="account")
app.add_typer(account.wallet_app, name="wallet")
app.command("whoami")(account.whoami)
app.command("submit")(jobs.submit)
app.command("quote")(jobs.quote)
app.command("jobs")(jobs.list_jobs)
app.add_typer(jobs.job_app, name="job")
app.command("deploy")(deploy.deploy)
app.command("deployments")(deploy.list_deployments)
app.add_typer(deploy.deployment_app, name="deployment")
app.command("chat")(deploy.chat)
app.command("offers")(offers.offers)
app.add_typer(ledger.ledger_app, name="ledger")
app.add_typer(train.train_app, name="train")
app.add_typer(governance.governance_app, name="governance")
app.add_typer(operator.operator_app, name="operator")
app.command("slashes")(operator.slashes)
app.command("sim")(sim.sim)
app.add_typer(data.data_app, name="data")
app.command("serve")(serve.serve)


def main() -> None:
    try:
        app()
    except GPUFlexError as err:
        # escaped: a message may quote input holding brackets, e.g. a query's "region in [eu, us]"
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]error:[/] {escape(err.message)}", highlight=False
        )
        sys.exit(1)
