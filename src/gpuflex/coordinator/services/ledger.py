"""The ledger's storage: appends signed journal entries and keeps balances, in the caller's transaction.

The arithmetic and the hash chain are the pure ``gpuflex.ledger`` package; this module only
serializes appends (a PostgreSQL advisory lock; SQLite's ``BEGIN IMMEDIATE`` already does),
refuses any posting that would leave a balance negative, so a failed check writes nothing, and
signs each entry's hash with the coordinator's ledger key. The key rides in the session's ``info``
(``SIGNING_KEY``; ``CoordinatorContext.tx`` puts it there), so no caller has to pass it along.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.auth.signing import NodeKey
from gpuflex.coordinator.db import AccountBalance, JournalEntry, lock
from gpuflex.ledger.journal import Entry, check_funds, make_entry, signed_message

_JOURNAL_LOCK_KEY = 0x6770_7566  # "gpuf": one advisory lock serializes journal appends on PostgreSQL
SIGNING_KEY = "gpuflex.ledger_key"  # session.info key of the NodeKey that signs appended entries


def _to_entry(row: JournalEntry) -> Entry:
    return Entry(
        seq=row.seq,
        at=row.at,
        kind=row.kind,
        memo=row.memo,
        postings=tuple((a, int(n)) for a, n in row.postings),
        prev_hash=row.prev_hash,
        hash=row.hash,
        signature=row.signature,
    )


def _signing_key(session: Session) -> NodeKey:
    key = session.info.get(SIGNING_KEY)
    if key is None:
        raise RuntimeError("this session carries no ledger signing key: open it with CoordinatorContext.tx()")
    return key


def public_key(session: Session) -> str:
    """The hex public key this coordinator signs the journal with: what verifiers should trust."""
    return _signing_key(session).public_key_hex


def balance(session: Session, account: str) -> int:
    row = session.get(AccountBalance, account)
    return row.balance if row else 0


def balances_under(session: Session, prefix: str) -> dict[str, int]:
    """The positive balances of the accounts whose names start with ``prefix``, keyed by the rest."""
    rows = session.scalars(
        select(AccountBalance).where(AccountBalance.account.startswith(prefix), AccountBalance.balance > 0)
    )
    return {row.account.removeprefix(prefix): row.balance for row in rows}


def append(
    session: Session, *, kind: str, memo: str, postings: Sequence[tuple[str, int]], now: float
) -> Entry:
    """Append one balanced, signed entry and apply it to the balances, or raise and write nothing."""
    key = _signing_key(session)
    lock(session, _JOURNAL_LOCK_KEY)
    head = session.scalars(select(JournalEntry).order_by(JournalEntry.seq.desc()).limit(1)).first()
    at = datetime.fromtimestamp(now, UTC).isoformat(timespec="microseconds")
    entry = make_entry(
        _to_entry(head) if head else None, at=at, kind=kind, memo=memo, postings=tuple(postings)
    )
    rows = {
        account: session.get(AccountBalance, account, with_for_update=True) for account, _ in entry.postings
    }
    check_funds({a: row.balance for a, row in rows.items() if row is not None}, entry.postings)
    for account, amount in entry.postings:
        row = rows[account]
        if row is None:
            row = rows[account] = AccountBalance(account=account, balance=0)
            session.add(row)
        row.balance += amount
    entry = replace(entry, signature=key.private_key.sign(signed_message(entry.hash)).hex())
    session.add(
        JournalEntry(
            seq=entry.seq,
            at=entry.at,
            kind=entry.kind,
            memo=entry.memo,
            postings=[list(p) for p in entry.postings],
            prev_hash=entry.prev_hash,
            hash=entry.hash,
            signature=entry.signature,
        )
    )
    session.flush()
    return entry


def entries(session: Session, *, after_seq: int = 0, limit: int | None = None) -> list[Entry]:
    query = select(JournalEntry).where(JournalEntry.seq > after_seq).order_by(JournalEntry.seq)
    if limit is not None:
        query = query.limit(limit)
    return [_to_entry(row) for row in session.scalars(query)]
