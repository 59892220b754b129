"""The journal on the wire: ``Entry`` <-> ``LedgerEntry``, and checking a whole export offline."""

from __future__ import annotations

from collections.abc import Iterable

from gpuflex.errors import BadRequest
from gpuflex.ledger.journal import ChainReport, Entry, verify_chain
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
    names (which proves the journal is the one its key holder signed, not who holds the key).

    Without a key to check against, nothing is checked: a ``BadRequest`` says why (a pinned key that is
    not a key, or not the key the export is signed with; an export naming none and none pinned)."""
    named = export.public_key.lower()
    key = check_public_key(public_key) if public_key is not None else named
    if not key:
        raise BadRequest("the export names no public key to check its signatures against: pin one you trust")
    if named and named != key:
        raise BadRequest(
            f"key mismatch: the export is signed by key {named}, not by the key you trust ({key}); "
            "its entries were not checked"
        )
    return verify_chain(from_export(export), public_key=key)


def check_public_key(hex_key: str) -> str:
    """``hex_key``, lower-cased, if it is an Ed25519 public key; else a ``BadRequest`` saying what one is."""
    try:
        if len(bytes.fromhex(hex_key)) == 32:
            return hex_key.lower()
    except ValueError:
        pass
    raise BadRequest(f"{hex_key!r} is not an Ed25519 public key: a key is 64 hex digits")
