"""The journal on the wire: ``Entry`` <-> ``LedgerEntry``, and checking a whole export offline."""

from __future__ import annotations

from collections.abc import Iterable

from gpuflex.ledger.journal import ChainReport, Entry, verify_chain
from gpuflex.protocol.messages import LedgerEntry, LedgerExport, Posting


def to_export(entries: Iterable[Entry]) -> LedgerExport:
    return LedgerExport(
        entries=[
            LedgerEntry(
                seq=e.seq,
                at=e.at,
                kind=e.kind,
                memo=e.memo,
                prev_hash=e.prev_hash,
                hash=e.hash,
                postings=[Posting(account=a, amount=n) for a, n in e.postings],
            )
            for e in entries
        ]
    )


def from_export(export: LedgerExport) -> list[Entry]:
    return [
        Entry(
            seq=e.seq,
            at=e.at,
            kind=e.kind,
            memo=e.memo,
            prev_hash=e.prev_hash,
            hash=e.hash,
            postings=tuple((p.account, p.amount) for p in e.postings),
        )
        for e in export.entries
    ]


def verify_export(export: LedgerExport) -> ChainReport:
    """Re-check an exported journal: every hash, the chain, balanced postings, no overdraft."""
    return verify_chain(from_export(export))
