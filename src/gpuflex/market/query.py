"""The offer query language: filter and sort the market's offers, Vast.ai-style.

    gpuflex offers "vram>=16 tflops>=20 price<=0.5 reliability>=0.95 region in [eu, us]" --order price

A query is whitespace-separated terms, all of which must hold; the empty query matches everything.
A term is ``field op value`` with ``op`` one of ``>= <= > < = != ==``, or ``field in [v1, v2, ...]``
(any of). Spaces around the operator are allowed. A value is a number, a bare word, or a quoted
string (``gpu="RTX 4090"``).

Fields, and the ``Offer`` attribute each reads:

- numbers: ``vram`` (GB), ``tflops``, ``price`` (credits/hour), ``reliability`` (the reputation
  score, 0..1), ``hours`` (hours left on offer; an open-ended node counts as infinitely many, so it
  satisfies any ``hours>=`` and sorts last on ``hours``).
- words, compared case-insensitively with ``= != in`` only: ``region``, ``name``; ``kind``
  (core|community), ``device`` (cpu|cuda) and ``state`` (online|lost|left) refuse other values.
  ``gpu`` is the node's first GPU's name and ``=`` is a case-insensitive *substring* match, as a job
  spec's ``accelerators`` are: ``gpu=4090`` matches "NVIDIA GeForce RTX 4090". A CPU-only node has
  no GPU: it matches only ``gpu!=...``. A missing value (no GPU, reliability not known) satisfies
  only ``!=``.

An order is comma-separated fields, each ascending or, with a leading ``-``, descending
(``price,-reliability``); missing values sort last either way; ties keep the default order (online
first, cheapest, then node id).

A bad query or order raises ``QueryError`` (a ``BadRequest``) whose message names the problem and
shows the text with a caret line under the offending token. Pure: no I/O.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import Offer

Op = Literal[">=", "<=", ">", "<", "=", "!=", "in"]
Value = float | str


class QueryError(BadRequest):
    """A query or order that does not parse; ``position`` and ``length`` locate the bad token."""

    def __init__(self, reason: str, text: str, position: int, length: int = 1, *, source: str = "query"):
        self.reason = reason
        self.text = text
        self.position = position
        self.length = max(1, length)
        shown = "".join(c if c.isprintable() else " " for c in text)
        caret = " " * position + "^" * self.length
        super().__init__(f"bad {source} at column {position + 1}: {reason}\n  {shown}\n  {caret}")


@dataclass(frozen=True)
class Field:
    name: str
    read: Callable[[Offer], Value | None]
    numeric: bool
    choices: tuple[str, ...] = ()  # the only values a word field can take; empty: any
    substring: bool = False  # "=" is a case-insensitive substring match
    none_is: float | None = None  # what a missing number counts as (hours: open-ended is infinite)


FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field("vram", lambda o: o.vram_gb, numeric=True),
        Field("tflops", lambda o: o.tflops, numeric=True),
        Field("price", lambda o: o.price_per_hour, numeric=True),
        Field("reliability", lambda o: o.reliability, numeric=True),
        Field("hours", lambda o: o.hours, numeric=True, none_is=math.inf),
        Field("region", lambda o: o.region, numeric=False),
        Field("kind", lambda o: o.kind, numeric=False, choices=("core", "community")),
        Field("gpu", lambda o: o.gpu, numeric=False, substring=True),
        Field("device", lambda o: o.device, numeric=False, choices=("cpu", "cuda")),
        Field("state", lambda o: o.state, numeric=False, choices=("online", "lost", "left")),
        Field("name", lambda o: o.name, numeric=False),
    )
}
_KNOWN = ", ".join(FIELDS)


@dataclass(frozen=True)
class Term:
    field: str
    op: Op
    values: tuple[Value, ...]  # one, except for "in"

    def matches(self, offer: Offer) -> bool:
        f = FIELDS[self.field]
        value = f.read(offer)
        if value is None:
            value = f.none_is
        if value is None:
            return self.op == "!="
        if f.numeric:
            return _compare_number(float(value), self.op, self.values)
        return _compare_word(str(value).casefold(), self.op, self.values, f.substring)


@dataclass(frozen=True)
class Query:
    terms: tuple[Term, ...] = ()

    def matches(self, offer: Offer) -> bool:
        return all(t.matches(offer) for t in self.terms)


@dataclass(frozen=True)
class SortKey:
    field: str
    descending: bool = False


_NUMBER_OPS: dict[str, Callable[[float, Value], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
    "!=": operator.ne,
}


def _compare_number(x: float, op: Op, values: tuple[Value, ...]) -> bool:
    return x in values if op == "in" else _NUMBER_OPS[op](x, values[0])


def _compare_word(x: str, op: Op, values: tuple[Value, ...], substring: bool) -> bool:
    def hit(v: Value) -> bool:
        v = str(v).casefold()
        return v in x if substring else v == x

    if op == "!=":
        return not hit(values[0])
    return any(hit(v) for v in values)  # "=" has one value, "in" several


# -- lexing ---------------------------------------------------------------------------------

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_OPERATORS = (">=", "<=", "!=", "==", ">", "<", "=")
_OPERATOR_CHARS = "<>=!"
_WORD_STOP = set(_OPERATOR_CHARS) | set("[],\"'")


@dataclass(frozen=True)
class _Token:
    kind: Literal["word", "string", "op", "[", "]", ","]
    text: str  # the token's value (a string's content, without its quotes)
    start: int
    end: int


def _tokens(text: str) -> list[_Token]:
    out: list[_Token] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "[],":
            out.append(_Token(c, c, i, i + 1))  # type: ignore[arg-type]
            i += 1
        elif c in "\"'":
            close = text.find(c, i + 1)
            if close < 0:
                raise QueryError(f"unterminated quote {c}", text, i, len(text) - i)
            out.append(_Token("string", text[i + 1 : close], i, close + 1))
            i = close + 1
        elif c in _OPERATOR_CHARS:
            j = i
            while j < len(text) and text[j] in _OPERATOR_CHARS:
                j += 1
            if text[i:j] not in _OPERATORS:
                raise QueryError(
                    f"unknown operator '{text[i:j]}' (use {' '.join(_OPERATORS)} or in [...])", text, i, j - i
                )
            out.append(_Token("op", text[i:j], i, j))
            i = j
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in _WORD_STOP:
                j += 1
            out.append(_Token("word", text[i:j], i, j))
            i = j
    return out


# -- parsing --------------------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokens(text)
        self.i = 0

    def error(self, reason: str, token: _Token | None) -> QueryError:
        if token is None:  # the text ended: point just past it
            return QueryError(reason, self.text, len(self.text))
        return QueryError(reason, self.text, token.start, token.end - token.start)

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> _Token | None:
        token = self.peek()
        self.i += token is not None
        return token

    def query(self) -> Query:
        terms = []
        while self.peek() is not None:
            terms.append(self.term())
        return Query(tuple(terms))

    def term(self) -> Term:
        name = self.take()
        if name.kind != "word":
            raise self.error(f"expected a field name, got '{name.text}' (known: {_KNOWN})", name)
        field = FIELDS.get(name.text.lower())
        if field is None:
            raise self.error(f"unknown field '{name.text}' (known: {_KNOWN})", name)
        op = self.take()
        if op is not None and op.kind == "word" and op.text.lower() == "in":
            return Term(field.name, "in", self.values_list(field, op))
        if op is None or op.kind != "op":
            where = f", got '{op.text}'" if op is not None else ""
            raise self.error(
                f"missing operator after '{name.text}'{where} (use {' '.join(_OPERATORS)} or in [...])", op
            )
        symbol = "=" if op.text == "==" else op.text
        if not field.numeric and symbol not in ("=", "!="):
            raise self.error(f"'{field.name}' is a word: compare it with = != or in [...]", op)
        return Term(field.name, symbol, (self.value(field),))  # type: ignore[arg-type]

    def values_list(self, field: Field, in_token: _Token) -> tuple[Value, ...]:
        opening = self.take()
        if opening is None or opening.kind != "[":
            got = f", got '{opening.text}'" if opening is not None else ""
            raise self.error(f"'in' needs a list like [a, b]{got}", opening or in_token)
        values = []
        while True:
            if self.peek() is None:
                raise QueryError("unterminated '['", self.text, opening.start, len(self.text) - opening.start)
            values.append(self.value(field))
            token = self.take()
            if token is None:
                raise QueryError("unterminated '['", self.text, opening.start, len(self.text) - opening.start)
            if token.kind == "]":
                return tuple(values)
            if token.kind != ",":
                raise self.error(f"expected ',' or ']' in the list, got '{token.text}'", token)

    def value(self, field: Field) -> Value:
        token = self.take()
        if token is None or token.kind not in ("word", "string"):
            got = f", got '{token.text}'" if token is not None else ""
            raise self.error(f"missing value for '{field.name}'{got}", token)
        if field.numeric:
            if not _NUMBER.fullmatch(token.text):
                raise self.error(f"'{field.name}' is a number, got '{token.text}'", token)
            return float(token.text)
        if field.choices and token.text.casefold() not in field.choices:
            raise self.error(
                f"unknown {field.name} '{token.text}' (one of: {', '.join(field.choices)})", token
            )
        return token.text


def parse(text: str) -> Query:
    """The query ``text`` means; ``QueryError`` pointing at the bad token if it means nothing."""
    return _Parser(text).query()


_ORDER_KEY = rf"\s*[+-]?\s*({'|'.join(FIELDS)})\s*"
# What ``parse_order`` takes, for the OpenAPI schema (lower-case: it also takes the names in any case).
ORDER_PATTERN = rf"^(\s*|{_ORDER_KEY}(,{_ORDER_KEY})*)$"


def parse_order(text: str) -> tuple[SortKey, ...]:
    """Sort keys from ``price,-reliability``; ``QueryError`` naming an unknown or empty key."""
    if not text.strip():
        return ()
    keys = []
    start = 0
    for part in text.split(","):
        key = part.strip()
        name = key[1:].strip() if key.startswith(("+", "-")) else key
        if name.lower() not in FIELDS:
            what = f"unknown sort key '{key}'" if key else "empty sort key"
            at = start + len(part) - len(part.lstrip())
            known = f"known: {_KNOWN}; a leading '-' sorts descending"
            raise QueryError(f"{what} ({known})", text, at, len(key), source="order")
        keys.append(SortKey(name.lower(), descending=key.startswith("-")))
        start += len(part) + 1
    return tuple(keys)


def _default_order(offer: Offer) -> tuple[bool, float, str]:
    return (offer.state != "online", offer.price_per_hour, offer.node_id)


def _compare(keys: Sequence[SortKey], a: Offer, b: Offer) -> int:
    for key in keys:
        f = FIELDS[key.field]
        x, y = (f.none_is if v is None else v for v in (f.read(a), f.read(b)))
        if x is None or y is None:
            if (x is None) != (y is None):
                return 1 if x is None else -1  # missing last, whichever the direction
            continue
        if not f.numeric:
            x, y = str(x).casefold(), str(y).casefold()
        if x != y:
            return (1 if x > y else -1) * (-1 if key.descending else 1)
    return 0


def select(offers: Iterable[Offer], query: Query, order: Sequence[SortKey] = ()) -> list[Offer]:
    """The offers ``query`` matches, sorted by ``order`` (then the default order)."""
    chosen = sorted((o for o in offers if query.matches(o)), key=_default_order)
    return sorted(chosen, key=functools.cmp_to_key(functools.partial(_compare, order)))
