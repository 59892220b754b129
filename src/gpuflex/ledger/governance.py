"""Governance rules: which network parameters stake may change, within what ranges, and the tally.

A node proposes a new value for one parameter; staked nodes vote with their stake; when voting
closes the proposal passes if, and only if,

- **quorum**: the stake that voted (yes + no + abstain) is at least ``quorum`` of all stake, and
- **majority**: the yes stake is strictly greater than the no stake (a tie fails).

Abstaining counts toward the quorum only: it says "I took part" without taking a side. Adding yes
stake can never turn a pass into a fail, and below quorum nothing passes. As with any turnout
quorum, a "no" vote that completes the quorum can let a yes majority pass (the quorum paradox):
opponents who want a proposal to fail for lack of turnout must stay away, not vote no. Stake is integer
micro-credits and the quorum test is exact (a ``Fraction``), so 40% of 10 is 4, not 4.0000000001.

It lives in the ledger package because a vote's weight *is* a ledger balance (``stake:<node>``) and
every step is a journal record (``RECORD_KINDS``); like the rest of the package it does no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import get_args

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import VoteChoice

CHOICES: tuple[str, ...] = get_args(VoteChoice)


@dataclass(frozen=True)
class Parameter:
    """A governable network parameter: its type and the closed range of values a proposal may set."""

    name: str
    type: type[int] | type[float]
    minimum: float
    maximum: float | None  # None: no upper bound
    unit: str
    description: str

    def check(self, value: float) -> int | float:
        """The value as this parameter's type; BadRequest naming the parameter if it does not fit."""
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadRequest(f"{self.name} needs a finite number, got {value!r}")
        if self.type is int and value != int(value):
            raise BadRequest(f"{self.name} takes a whole number, got {value!r}")
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            raise BadRequest(f"{self.name} must be within {self.range()}, got {value!r}")
        return self.type(value)

    def range(self) -> str:
        upper = "" if self.maximum is None else _number(self.maximum)
        return f"{_number(self.minimum)}..{upper} {self.unit}".rstrip()

    def show(self, value: float) -> str:
        return f"{_number(self.type(value))} {self.unit}".rstrip()


def _number(value: float) -> str:
    return f"{value:.15g}"  # 2000, 0.5, 1500000: no trailing zeros


PARAMETERS: dict[str, Parameter] = {
    p.name: p
    for p in (
        Parameter("platform_fee_bps", int, 0, 10_000, "bps", "the platform's cut of each provider payout"),
        Parameter("heartbeat_interval_s", float, 0.1, 3600, "s", "how often a node must send a heartbeat"),
        Parameter("heartbeat_misses", int, 1, 100, "", "missed heartbeats before a node is lost"),
        Parameter("min_stake", float, 0, None, "credits", "stake a node must bond to take work"),
        Parameter("audit_rate", float, 0, 1, "", "fraction of contributions audited"),
    )
}


def parameter(name: str) -> Parameter:
    """The governable parameter ``name``; BadRequest listing the governable ones if unknown."""
    if name not in PARAMETERS:
        raise BadRequest(f"unknown parameter {name!r}; governable: {', '.join(PARAMETERS)}")
    return PARAMETERS[name]


@dataclass(frozen=True)
class Tally:
    """Stake (micro-credits) per choice against all stake, and what it decides."""

    yes: int
    no: int
    abstain: int
    total_stake: int
    quorum: Fraction

    @property
    def voted(self) -> int:
        return self.yes + self.no + self.abstain

    @property
    def quorum_met(self) -> bool:
        return self.voted > 0 and self.voted >= self.quorum * self.total_stake

    @property
    def passed(self) -> bool:
        return self.quorum_met and self.yes > self.no


def tally(votes: Iterable[tuple[str, int]], *, total_stake: int, quorum: float) -> Tally:
    """Add up ``(choice, weight)`` votes. ``quorum`` is a fraction of ``total_stake`` in (0, 1]."""
    if not 0 < quorum <= 1:
        raise ValueError(f"quorum must be in (0, 1], got {quorum!r}")
    sums = dict.fromkeys(CHOICES, 0)
    for choice, weight in votes:
        if choice not in sums:
            raise ValueError(f"unknown vote choice {choice!r}; one of {', '.join(CHOICES)}")
        if weight <= 0:
            raise ValueError(f"a vote weighs more than nothing, got {weight!r}")
        sums[choice] += weight
    # str() first: Fraction(0.4) would be the binary float's 0.4000000000000000222...
    return Tally(**sums, total_stake=total_stake, quorum=Fraction(str(quorum)))
