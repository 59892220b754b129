"""``gpuflex coordinator serve | migrate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console

from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import BadRequest
from gpuflex.jsonlog import LogFormat

coordinator_app = typer.Typer(help="Run the coordinator (the operator's service).", no_args_is_help=True)
console = Console(stderr=True)

DataDir = Annotated[Path | None, typer.Option(help="database, blobs and keys \\[env GPUFLEX_DATA_DIR]")]
DatabaseUrl = Annotated[str | None, typer.Option(help="SQLAlchemy URL \\[env GPUFLEX_DATABASE_URL]")]
LogFormatOption = Annotated[
    LogFormat | None, typer.Option(help="text, or json: one object per line \\[env GPUFLEX_LOG_FORMAT]")
]


def _settings(data_dir: Path | None, database_url: str | None, **more: object) -> CoordinatorSettings:
    """The settings from the options and ``GPUFLEX_*``; a bad value is one line naming its variable."""
    given = {"data_dir": data_dir, "database_url": database_url, **more}
    try:
        return CoordinatorSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        named = (f"GPUFLEX_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in err.errors())
        problems = "; ".join(named)
        raise BadRequest(f"bad setting: {problems}") from None
    except SettingsError as err:  # a value that is not even JSON where JSON is expected
        raise BadRequest(f"bad setting: {err} (GPUFLEX_* variables)") from None


@coordinator_app.command("migrate")
def migrate(data_dir: DataDir = None, database_url: DatabaseUrl = None) -> None:
    """Create or upgrade the database schema."""
    from gpuflex.coordinator.migrate import upgrade

    settings = _settings(data_dir, database_url)
    upgrade(settings.sqlalchemy_url)
    console.print(f"database at {settings.sqlalchemy_url.split('@')[-1]} is up to date")


@coordinator_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8750,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    migrate_first: Annotated[
        bool, typer.Option("--migrate/--no-migrate", help="upgrade the schema first")
    ] = True,
    log_format: LogFormatOption = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="serve HTTPS with this PEM certificate (chain); clients verify it (--ca)"),
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="the private key of --tls-cert (PEM)")] = None,
) -> None:
    """Serve the HTTP API (OpenAPI docs at /docs), the dashboard (/dashboard) and metrics (/metrics)."""
    import uvicorn

    from gpuflex import jsonlog
    from gpuflex.coordinator.app import create_app
    from gpuflex.coordinator.migrate import upgrade

    if (tls_cert is None) != (tls_key is None):
        raise BadRequest("--tls-cert and --tls-key go together: give both to serve HTTPS, or neither")
    for flag, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not path.is_file():
            raise BadRequest(f"{flag} {path}: no such file")
    settings = _settings(data_dir, database_url, log_format=log_format)
    jsonlog.configure(settings.log_format)
    if migrate_first:
        upgrade(settings.sqlalchemy_url)
    # Made now, not on first use: the operator reads them from data_dir before anyone has called.
    settings.resolved_core_token()
    settings.resolved_operator_token()
    app = create_app(settings)  # checks the blob store: one that cannot be reached stops us here
    core = "GPUFLEX_CORE_TOKEN" if settings.core_token else settings.data_dir / "core_token"
    operator = "GPUFLEX_OPERATOR_TOKEN" if settings.operator_token else settings.data_dir / "operator_token"
    console.print(
        f"serving on {'https' if tls_cert else 'http'}://{host}:{port} (dashboard at /dashboard, docs at "
        f"/docs); core token in {core}, "
        f"operator token in {operator}"
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=settings.keep_alive_s,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
