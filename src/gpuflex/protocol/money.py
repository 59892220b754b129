"""Credits are USD-pegged; the ledger counts integer micro-credits so sums are exact."""

MICRO = 1_000_000


def to_micro(credits: float) -> int:
    return round(credits * MICRO)


def to_credits(micro: int) -> float:
    return micro / MICRO


def credits_text(amount: float) -> str:
    """An amount of credits as people read it (CLI, API messages): as many decimals as it has, up to the
    micro-credit, at least two: 0.001 reads 0.001 (not 0.00), 10 reads 10.00, 0.0010824 reads 0.001082."""
    text = f"{amount:.6f}".rstrip("0")
    whole, _, decimals = text.partition(".")
    return f"{whole}.{decimals.ljust(2, '0')}"
