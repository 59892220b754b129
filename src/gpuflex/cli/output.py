"""How the CLI prints what it lists: tables that stay readable at 80 columns and never cut an id, JSON
for scripts (``--json`` on every listing command), and credits with the precision they were given."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from gpuflex.protocol.money import MICRO, format_credits, to_credits

Json = Annotated[bool, typer.Option("--json", help="print JSON (for scripts) instead of a table")]


class _WholeWords(Table):
    """A ``Table`` that folds no word where the terminal allows: each column is at least as wide as the
    longest word of its header and cells, so at 80 columns "aggregator" stays whole, not "aggre|gator".
    Rich still wraps cells at spaces and shrinks the columns that have room to give."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._longest: list[int] = []  # per column, its longest word

    def add_column(self, header: str = "", **kwargs: Any) -> None:
        super().add_column(header, **kwargs)
        self._longest.append(_longest_word(header))

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*cells, **kwargs)
        for i, cell in enumerate(cells):
            if isinstance(cell, str):
                self._longest[i] = max(self._longest[i], _longest_word(cell))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Whole words with the usual padding where they fit, else with one space between columns;
        where even that is too wide, words fold as Rich folds them."""
        words = sum(self._longest)
        pad = next(
            (
                p
                for p in (1, 0)
                if words + 2 * p * len(self._longest) + self._extra_width <= options.max_width
            ),
            None,
        )
        self.padding = (0, 1 if pad is None else pad)
        for column, longest in zip(self.columns, self._longest, strict=True):
            column.min_width = None if pad is None else longest
        yield from super().__rich_console__(console, options)


def _longest_word(cell: str) -> int:
    return max((len(word) for word in Text.from_markup(cell).plain.split()), default=0)


def table(*columns: str, ids: Iterable[str] = (), title: str | None = None) -> Table:
    """A table whose ``ids`` columns are printed whole, never wrapped or cut with "…", so an id can be
    copied from any terminal; the other columns wrap between words to make room."""
    keep_whole = set(ids)
    out = _WholeWords(title=title)
    for name in columns:
        if name in keep_whole:
            out.add_column(name, no_wrap=True, overflow="ignore")
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


def at_least(amount: float) -> str:
    """``amount`` rounded up to the micro-credit: the least budget to give that is enough."""
    return credits(to_credits(math.ceil(amount * MICRO)))


def settled(what: str, state: str, spent: float, budget: float) -> str:
    """What a job or deployment that ended cost and what went back to its owner's wallet."""
    return (
        f"{what} {state}; spent {credits(spent)} of a {credits(budget)} budget, "
        f"{credits(budget - spent)} refunded"
    )
