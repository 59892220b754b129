"""The journal on the wire: ``Entry`` <-> ``LedgerEntry``, and checking a whole export offline."""

from __future__ import annotations

from collections.abc import Iterable

from gpuflex.ledger.journal import GENESIS_HASH, ChainReport, Entry, verify_chain
from gpuflex.protocol.messages import LedgerEntry, LedgerExport, Posting


def to_export(entries: Iterable[Entry], *, public_key: str = "") -> LedgerExport:
    """``public_key``: the hex Ed25519 key the entries are signed with (the coordinator's)."""
    return LedgerExport(
        public_key=public_key,
        entries=[
            LedgerEntry(
                seq=e.seq,
                at=e.at,
                kind=e.kind,
                memo=e.memo,
                prev_hash=e.prev_hash,
                hash=e.hash,
                signature=e.signature,
                postings=[Posting(account=a, amount=n) for a, n in e.postings],
            )
            for e in entries
        ],
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
            signature=e.signature,
        )
        for e in export.entries
    ]


def verify_export(export: LedgerExport, *, public_key: str | None = None) -> ChainReport:
    """Re-check an exported journal: every hash, the chain, balanced postings, no overdraft, and every
    signature, against ``public_key`` if you pinned the key you trust, else against the key the export
    names (which proves the journal is the one its key holder signed, not who holds the key)."""
    named = export.public_key.lower()
    key = (public_key or named).lower()
    problem = None
    if not key:
        problem = "the export names no public key to check its signatures against: pin one you trust"
    elif named and named != key:
        problem = f"the export is signed by key {named}, not by the key you trust ({key})"
    if problem:
        return ChainReport(ok=False, entries=0, head=GENESIS_HASH, problem=problem)
    return verify_chain(from_export(export), public_key=key)
