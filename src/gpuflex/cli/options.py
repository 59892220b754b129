"""Options shared by several commands."""

from typing import Annotated, get_args

import typer

from gpuflex.errors import BadRequest
from gpuflex.protocol.deployment import ServeDtype

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


def _dtype(value: str) -> str:
    """One line for a dtype that is none of them (typer's own refusal is a box of usage)."""
    if value not in get_args(ServeDtype):
        raise BadRequest(f"--dtype {value}: give one of {', '.join(get_args(ServeDtype))}")
    return value


Dtype = Annotated[
    str,
    typer.Option(
        callback=_dtype,
        help="the weights' and KV cache's dtype: auto (the model's when 16-bit, else bf16), bf16, "
        "fp16 (needs CUDA: fp32 elsewhere) or fp32",
    ),
]
