"""Metering: what a lease of some seconds costs at a price per hour, and what tokens served under a
deployment key cost at its prices per million tokens, in micro-credits.

Rounding always goes the same way, down, and only once: whole seconds (floor) x price / 3600,
floored to a micro-credit. A provider therefore sees at most one second plus one micro-credit
less than the exact product per lease, never more; a consumer is never billed for time that was
not run. Doing the arithmetic on integers keeps it exact and identical on every machine.
"""

from __future__ import annotations

import math

from gpuflex.errors import BadRequest

SECONDS_PER_HOUR = 3600


def lease_cost_micro(seconds: float, price_per_hour_micro: int) -> int:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        raise BadRequest(f"lease seconds must be a finite number >= 0, got {seconds!r}")
    if type(price_per_hour_micro) is not int or price_per_hour_micro < 0:
        raise BadRequest(
            f"price per hour must be an integer of micro-credits >= 0, got {price_per_hour_micro!r}"
        )
    return math.floor(seconds) * price_per_hour_micro // SECONDS_PER_HOUR


TOKENS_PER_PRICE = 1_000_000  # token prices are quoted per million tokens


def token_cost_micro(
    prompt_tokens: int, completion_tokens: int, price_in_micro: int, price_out_micro: int
) -> int:
    """What ``prompt_tokens`` input and ``completion_tokens`` output tokens cost at prices in micro-credits
    per million tokens, floored once to a micro-credit. Applied to a key's running totals (never per
    request), so the rounding loses under one micro-credit over the key's whole life."""
    for name, value in locals().items():
        if type(value) is not int or value < 0:
            raise BadRequest(f"{name} must be an integer >= 0, got {value!r}")
    return (prompt_tokens * price_in_micro + completion_tokens * price_out_micro) // TOKENS_PER_PRICE
