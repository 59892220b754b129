"""Settlement: the postings of the one entry that empties a job's escrow.

Providers are paid their metered cost less the platform fee, the platform gets the fees and the
consumer gets back whatever is left. If the metered costs exceed the escrow (the budget ran out
between meter readings), every provider is scaled down in proportion; largest-remainder
rounding hands out the last micro-credits so the escrow still empties exactly. Fees are
floored, so rounding favours the provider by under one micro-credit.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuflex.errors import BadRequest
from gpuflex.ledger.accounts import PLATFORM_FEES

BPS = 10_000


def settle_job(
    *, escrow_balance: int, costs: Mapping[str, int], fee_bps: int, consumer_account: str, escrow_account: str
) -> tuple[tuple[str, int], ...]:
    """Postings sorted by account, zero amounts omitted; empty when the escrow is already empty.

    ``costs`` maps provider account -> metered micro-credits.
    """
    _validate(escrow_balance, costs, fee_bps, consumer_account, escrow_account)
    paid = scale_to(costs, escrow_balance)
    amounts: dict[str, int] = {escrow_account: -escrow_balance}
    fees = 0
    for account, pay in paid.items():
        fee = pay * fee_bps // BPS
        amounts[account] = pay - fee
        fees += fee
    amounts[PLATFORM_FEES] = fees
    amounts[consumer_account] = escrow_balance - sum(paid.values())
    return tuple(sorted((account, amount) for account, amount in amounts.items() if amount != 0))


def scale_to(costs: Mapping[str, int], limit: int) -> dict[str, int]:
    """Costs unchanged if they fit in ``limit``; else scaled in proportion to sum exactly to ``limit``:
    what settlement pays each provider (before the fee) out of an escrow of ``limit``."""
    total = sum(costs.values())
    if total <= limit:
        return dict(costs)
    scaled = {account: cost * limit // total for account, cost in costs.items()}
    short = limit - sum(scaled.values())
    by_remainder = sorted(costs, key=lambda account: (-(costs[account] * limit % total), account))
    for account in by_remainder[:short]:
        scaled[account] += 1
    return scaled


def _validate(
    escrow_balance: int, costs: Mapping[str, int], fee_bps: int, consumer_account: str, escrow_account: str
) -> None:
    if type(escrow_balance) is not int or escrow_balance < 0:
        raise BadRequest(f"escrow balance must be an integer >= 0, got {escrow_balance!r}")
    if type(fee_bps) is not int or not 0 <= fee_bps <= BPS:
        raise BadRequest(f"fee must be 0..{BPS} basis points, got {fee_bps!r}")
    named = {consumer_account, escrow_account, PLATFORM_FEES}
    if len(named) != 3 or not all(isinstance(a, str) and a for a in named):
        raise BadRequest("consumer, escrow and platform fee accounts must be distinct non-empty names")
    for account, cost in costs.items():
        if not isinstance(account, str) or not account or account in named:
            raise BadRequest(f"provider account {account!r} must be a non-empty name of its own")
        if type(cost) is not int or cost < 0:
            raise BadRequest(f"cost for {account} must be an integer >= 0, got {cost!r}")
