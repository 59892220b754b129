"""The ledger as a consumer exports it, checked: what the money tests start from."""

from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import balances, verify_chain


def sound_totals(client) -> dict[str, int]:
    """The balances of the journal ``client`` exports, once its chain verifies and they sum to zero."""
    journal = from_export(client.ledger())
    assert verify_chain(journal).ok
    totals = balances(journal)
    assert sum(totals.values()) == 0
    return totals
