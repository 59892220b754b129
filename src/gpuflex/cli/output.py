"""How the CLI prints what it lists: tables that stay readable at 80 columns and never cut an id, JSON
for scripts (``--json`` on every listing command), and credits with the precision they were given."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.table import Table

from gpuflex.protocol.money import format_credits

Json = Annotated[bool, typer.Option("--json", help="print JSON (for scripts) instead of a table")]


def table(*columns: str, ids: Iterable[str] = (), title: str | None = None) -> Table:
    """A table whose ``ids`` columns are printed whole, never wrapped or cut with "…", so an id can be
    copied from any terminal; the other columns wrap to make room."""
    keep_whole = set(ids)
    out = Table(title=title)
    for name in columns:
        if name in keep_whole:
            out.add_column(name, no_wrap=True, min_width=len(name), overflow="ignore")
        else:
            out.add_column(name, overflow="fold")
    return out


def print_json(data: BaseModel | Iterable[BaseModel] | Any) -> None:
    """Print a protocol model, or a list of them, as indented JSON on stdout."""
    typer.echo(json.dumps(_plain(data), indent=2))


def _plain(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list | tuple):
        return [_plain(item) for item in data]
    return data


def credits(amount: float) -> str:
    """An amount of credits with the precision it was given: 0.001 prints as 0.001 (not 0.00), 10 as
    10.00 (``protocol.money.format_credits``, which the dashboard prints budgets with too)."""
    return format_credits(amount)


def settled(what: str, state: str, spent: float, budget: float) -> str:
    """What a job or deployment that ended cost and what went back to its owner's wallet."""
    return (
        f"{what} {state}; spent {credits(spent)} of a {credits(budget)} budget, "
        f"{credits(budget - spent)} refunded"
    )
