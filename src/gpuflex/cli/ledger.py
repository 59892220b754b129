"""``gpuflex ledger export | verify``: anyone can re-check the journal's hash chain and the
coordinator's signature of every entry offline. The journal is public: no token needed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpuflex.cli.options import Token, Url
from gpuflex.cli.profile import public_client
from gpuflex.errors import BadRequest, GPUFlexError
from gpuflex.ledger.export import check_public_key, verify_export
from gpuflex.protocol.messages import LedgerExport

ledger_app = typer.Typer(help="Audit the ledger.", no_args_is_help=True)
console = Console()


def _load(source: str | None, url: str | None, token: str | None) -> LedgerExport:
    if source is None or source.startswith(("http://", "https://")):
        return public_client(source or url, token).ledger()
    try:
        return LedgerExport.model_validate_json(Path(source).read_text())
    except OSError as err:
        raise BadRequest(f"cannot read {source}: {err.strerror}") from None
    except ValueError as err:
        raise BadRequest(f"{source} is not a ledger export: {str(err).splitlines()[0]}") from None


@ledger_app.command("export")
def export(
    output: Annotated[Path, typer.Option("-o", "--output")] = Path("ledger.json"),
    url: Url = None,
    token: Token = None,
) -> None:
    """Save the journal as JSON for offline verification."""
    output.write_text(public_client(url, token).ledger().model_dump_json(indent=1))
    console.print(f"ledger written to {output}")


@ledger_app.command("verify")
def verify(
    source: Annotated[str | None, typer.Option("--from", help="an export file or a coordinator URL")] = None,
    public_key: Annotated[
        str | None,
        typer.Option(
            "--public-key",
            help=escape("the key you trust to sign the journal, 64 hex digits [default: the export's]"),
        ),
    ] = None,
    url: Url = None,
    token: Token = None,
) -> None:
    """Re-check every entry's hash, the chain, the balancing of postings, that no balance went
    negative, and every entry's signature."""
    if public_key is not None:
        check_public_key(public_key)  # before fetching anything
    report = verify_export(_load(source, url, token), public_key=public_key)
    if not report.ok:
        raise GPUFlexError(f"ledger: {report.entries} entries, chain BROKEN: {report.problem}")
    console.print(
        f"ledger: {report.entries} entries, chain verified, signed by key {report.public_key} "
        f"(head {report.head[:16]})",
        soft_wrap=True,
    )
