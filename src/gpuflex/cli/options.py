"""Options shared by the consumer commands."""

from typing import Annotated

import typer

Url = Annotated[
    str | None, typer.Option("--url", help="coordinator URL \\[env GPUFLEX_URL; default: the profile's]")
]
Token = Annotated[
    str | None, typer.Option("--token", help="API token \\[env GPUFLEX_TOKEN; default: the profile's]")
]
Profile = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="use this saved profile (`gpuflex account profiles`) \\[env GPUFLEX_PROFILE; default: the "
        "default profile]",
    ),
]
Ca = Annotated[
    str | None,
    typer.Option(
        "--ca",
        help="trust the coordinator's HTTPS certificate if this CA (a PEM file) signed it \\[env GPUFLEX_CA; "
        "default: the profile's, else the system's CAs]",
    ),
]
