"""Credits are USD-pegged; the ledger counts integer micro-credits so sums are exact."""

MICRO = 1_000_000


def to_micro(credits: float) -> int:
    return round(credits * MICRO)


def to_credits(micro: int) -> float:
    return micro / MICRO


def format_credits(amount: float) -> str:
    """An amount of credits with as many decimals as it has, up to the micro-credit, at least two:
    a budget of 0.001 prints as 0.001 (not 0.00), 10 as 10.00, 0.0010824 as 0.001082."""
    text = f"{amount:.6f}".rstrip("0")
    whole, _, decimals = text.partition(".")
    return f"{whole}.{decimals.ljust(2, '0')}"
