"""Options shared by the consumer commands."""

from typing import Annotated

import typer

Url = Annotated[str | None, typer.Option("--url", help="coordinator URL [env GPUFLEX_URL]")]
Token = Annotated[str | None, typer.Option("--token", help="API token [env GPUFLEX_TOKEN]")]
