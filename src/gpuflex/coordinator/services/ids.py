"""Ids as people type them: whole, or any prefix that names one row, as Docker takes container ids.

Tables print ids whole (``j-3f2a9c1b7d0e``), and wherever an id is taken a unique prefix will do
(``j-3f``). A prefix is looked up only among the rows the caller may see (``scope``: a consumer's own
jobs), so it never tells anyone that someone else's id exists. A prefix that fits several rows is a
409 that lists them; one that fits none is a 404.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from gpuflex.errors import Conflict, NotFound

T = TypeVar("T")

LISTED = 10  # ids an ambiguous prefix's error names


def lookup(
    session: Session,
    model: type[T],
    given: str,
    *scope: ColumnElement[bool],
    what: str,
    for_update: bool = False,
) -> T:
    """The row of ``model`` whose ``id`` is ``given``, else the one whose id begins with it, among the
    rows ``scope`` allows; ``for_update`` locks it. ``what`` names the model in errors."""
    key: Any = model.id  # type: ignore[attr-defined]
    query = select(model).where(*scope)
    if for_update:
        query = query.with_for_update()
    row = session.scalars(query.where(key == given)).first()
    if row is not None:
        return row
    by_prefix = query.where(key.startswith(given, autoescape=True)).order_by(key).limit(LISTED + 1)
    # LIKE ignores case on SQLite: testing again here keeps a prefix case-sensitive on every database
    matches: list[Any] = [r for r in session.scalars(by_prefix) if given and r.id.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(f"no {what} {given}")
    raise Conflict(f"{what} id {given} is ambiguous: {listed(matches)} begin with it; give more of it")


def listed(rows: Sequence[Any]) -> str:
    """The ids of ``rows`` for an error, the first ``LISTED`` of them."""
    return ", ".join(r.id for r in rows[:LISTED]) + (", …" if len(rows) > LISTED else "")
