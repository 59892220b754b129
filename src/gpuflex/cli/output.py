"""How the CLI prints what it lists: tables that stay readable at 80 columns and never cut an id, JSON
for scripts (``--json`` on every listing command), and credits with the precision they were given."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from copy import copy
from dataclasses import replace
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from gpuflex.protocol.money import MICRO, format_credits, to_credits

Json = Annotated[bool, typer.Option("--json", help="print JSON (for scripts) instead of a table")]


class _WholeWords(Table):
    """A ``Table`` that folds no word where the terminal allows: each column is at least as wide as the
    longest word of its header and cells (a ``no_wrap`` column: its widest cell), so at 80 columns
    "completed" stays whole, not "compl|eted". Rich's own sizing shrinks columns below their longest word
    (it has no notion of one), so the widths are set here."""

    def __init__(self, drop: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._drop = list(drop)  # header names, least useful first
        self._longest: list[int] = []  # per column, its longest word
        self._widest: list[int] = []  # per column, its widest line

    def add_column(self, header: str = "", **kwargs: Any) -> None:
        super().add_column(header, **kwargs)
        self._longest.append(0)
        self._widest.append(0)
        self._measure(len(self.columns) - 1, header)

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*cells, **kwargs)
        for i, cell in enumerate(cells):
            if isinstance(cell, str):
                self._measure(i, cell)

    def _measure(self, i: int, cell: str) -> None:
        plain = Text.from_markup(cell).plain
        widest = max((cell_len(line) for line in plain.splitlines()), default=0)
        words = widest if self.columns[i].no_wrap else max(map(cell_len, plain.split()), default=0)
        self._longest[i] = max(self._longest[i], words)
        self._widest[i] = max(self._widest[i], widest)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The first that keeps every word whole: all columns with the usual padding, then with one space
        between them, then the same without the least useful ``drop`` column, and so on. Where none does,
        the longest words fold, as few as can; where even the ids do not fit, Rich folds as it does."""
        for dropped in range(len(self._drop) + 1):
            for pad in (1, 0):
                view = self._view(self._drop[:dropped], pad, options.max_width)
                if view is not None:
                    yield from Table.__rich_console__(view, console, options)
                    return
        view = self._view(self._drop, 0, options.max_width, fold=True)
        yield from Table.__rich_console__(view or self, console, options)

    def _view(self, gone: list[str], pad: int, max_width: int, fold: bool = False) -> Table | None:
        """This table without the columns ``gone`` (its caption names them), ``pad`` spaces each side of a
        cell, its columns as wide as ``_fit`` says; None where they do not fit in ``max_width``."""
        kept = [i for i, column in enumerate(self.columns) if column.header not in gone]
        view = copy(self)
        view.columns = [self.columns[i] for i in kept]
        view.padding = (0, pad)
        if gone:
            view.caption = f"not shown, too narrow: {', '.join(gone)}"
        room = max_width - view._extra_width - 2 * pad * len(kept)
        longest = [self._longest[i] for i in kept]
        if fold:
            longest = _shrink(longest, [not self.columns[i].no_wrap for i in kept], room)
        widths = _fit(longest, [self._widest[i] for i in kept], room)
        if widths is None:
            return None
        view.columns = [
            replace(self.columns[i], width=w, _index=j)
            for j, (i, w) in enumerate(zip(kept, widths, strict=True))
        ]
        return view


def _fit(longest: list[int], widest: list[int], room: int) -> list[int] | None:
    """Column widths within ``room``: each its longest word, then what is left to the columns that want
    least more first, each up to its widest line (so most cells take one line); None if the longest words
    alone take more."""
    widths = list(longest)
    spare = room - sum(widths)
    if spare < 0:
        return None
    for i in sorted(range(len(widths)), key=lambda i: widest[i] - longest[i]):
        more = min(widest[i] - widths[i], spare)
        widths[i] += more
        spare -= more
    return widths


def _shrink(longest: list[int], foldable: list[bool], room: int) -> list[int]:
    """The longest words narrowed, the longest first, until they fit in ``room`` (or nothing can fold):
    a 40-letter name folds, and "completed" beside it stays whole."""
    widths = list(longest)
    while sum(widths) > room:
        i = max(range(len(widths)), key=lambda i: widths[i] if foldable[i] else 0)
        if not foldable[i] or widths[i] <= 1:
            break
        widths[i] -= 1
    return widths


def table(
    *columns: str, ids: Iterable[str] = (), drop: Sequence[str] = (), title: str | None = None
) -> Table:
    """A table whose ``ids`` columns are printed whole, never wrapped or cut with "…", so an id can be
    copied from any terminal; the other columns wrap between words to make room. Where the words do not
    fit whole, the ``drop`` columns (headers, least useful first) go before any word is folded."""
    keep_whole = set(ids)
    out = _WholeWords(drop, title=title)
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
