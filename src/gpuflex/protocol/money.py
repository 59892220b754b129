"""Credits are USD-pegged; the ledger counts integer micro-credits so sums are exact."""

MICRO = 1_000_000


def to_micro(credits: float) -> int:
    return round(credits * MICRO)


def to_credits(micro: int) -> float:
    return micro / MICRO
