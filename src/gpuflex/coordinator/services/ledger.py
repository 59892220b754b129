"""The ledger's storage: appends journal entries and keeps balances, in the caller's transaction.

The arithmetic and the hash chain are the pure ``gpuflex.ledger`` package; this module only
serializes appends (a PostgreSQL advisory lock; SQLite's ``BEGIN IMMEDIATE`` already does) and
refuses any posting that would leave a balance negative, so a failed check writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import AccountBalance, JournalEntry, lock
from gpuflex.ledger.journal import Entry, check_funds, make_entry

_JOURNAL_LOCK_KEY = 0x6770_7566  # "gpuf": one advisory lock serializes journal appends on PostgreSQL


def _to_entry(row: JournalEntry) -> Entry:
    return Entry(
        seq=row.seq,
        at=row.at,
        kind=row.kind,
        memo=row.memo,
        postings=tuple((a, int(n)) for a, n in row.postings),
        prev_hash=row.prev_hash,
        hash=row.hash,
    )


def _balance_row(session: Session, account: str) -> AccountBalance:
    row = session.get(AccountBalance, account, with_for_update=True)
    if row is None:
        row = AccountBalance(account=account, balance=0)
        session.add(row)
    return row


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
    """Append one balanced entry and apply it to the balances, or raise and write nothing."""
    lock(session, _JOURNAL_LOCK_KEY)
    head = session.scalars(select(JournalEntry).order_by(JournalEntry.seq.desc()).limit(1)).first()
    at = datetime.fromtimestamp(now, UTC).isoformat(timespec="microseconds")
    entry = make_entry(
        _to_entry(head) if head else None, at=at, kind=kind, memo=memo, postings=tuple(postings)
    )
    rows = {account: _balance_row(session, account) for account, _ in entry.postings}
    check_funds({account: row.balance for account, row in rows.items()}, entry.postings)
    for account, amount in entry.postings:
        rows[account].balance += amount
    session.add(
        JournalEntry(
            seq=entry.seq,
            at=entry.at,
            kind=entry.kind,
            memo=entry.memo,
            postings=[list(p) for p in entry.postings],
            prev_hash=entry.prev_hash,
            hash=entry.hash,
        )
    )
    session.flush()
    return entry


def entries(session: Session, *, after_seq: int = 0, limit: int | None = None) -> list[Entry]:
    query = select(JournalEntry).where(JournalEntry.seq > after_seq).order_by(JournalEntry.seq)
    if limit is not None:
        query = query.limit(limit)
    return [_to_entry(row) for row in session.scalars(query)]
