"""``gpuflex offers``: the nodes on the market, picked and sorted by the offer query language
(``gpuflex.market.query``). The market is public: no token needed."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpuflex.cli.options import Token, Url
from gpuflex.cli.output import Json, print_json, table
from gpuflex.cli.profile import public_client

console = Console()

# escaped: Rich reads "[eu, us]" in a help text as markup and would drop it
QUERY_HELP = escape(
    'e.g. "vram>=16 tflops>=20 price<=0.5 reliability>=0.9 region in [eu, us] hours>=24"; '
    "fields: vram tflops price reliability hours region kind gpu device state name; empty: every node"
)
ORDER_HELP = escape(
    "sort keys, '-' for descending, e.g. price,-reliability [default: online first, cheapest]"
)


def offers(
    query: Annotated[str, typer.Argument(help=QUERY_HELP)] = "",
    order: Annotated[str, typer.Option(help=ORDER_HELP)] = "",
    json: Json = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """List the nodes on offer that the query matches, online and cheapest first unless --order says.
    The market is public: no token needed."""
    listed = public_client(url, token).offers(query, order)
    if json:
        print_json(listed)
        return
    # Five columns, each cell a few words: one line a node on a wide terminal, wrapped between words
    # (never inside an id or a word) at 80 columns.
    out = table("node", "name", "hardware", "offer", "region", ids=["node"])
    for o in listed:
        reliability = "reliability unknown" if o.reliability is None else f"{o.reliability:.0%} reliable"
        hours = "open-ended" if o.hours is None else f"{o.hours:.1f} h left"
        device = f"{o.gpu}, {o.vram_gb:.0f} GB" if o.gpu else o.device
        out.add_row(
            o.node_id,
            f"{o.name} ({o.kind})",
            f"{device}, {o.tflops:.3g} TFLOPS",
            f"{o.price_per_hour:.3f}/h, {reliability}, {hours}",
            f"{o.region}, {o.state}",
        )
    console.print(out)
