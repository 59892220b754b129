"""Consumer accounts: creation, API-token authentication, deposits and balances."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.auth.tokens import new_api_token, token_hash
from gpuflex.coordinator.db import Account, new_id
from gpuflex.coordinator.services import ledger
from gpuflex.errors import Conflict, Unauthorized
from gpuflex.ledger import accounts


def create(session: Session, name: str, now: float) -> tuple[Account, str]:
    """Make an account; returns it with its API token, which is shown only this once."""
    if session.scalars(select(Account).where(Account.name == name)).first():
        raise Conflict(f"an account named {name!r} exists already")
    token = new_api_token()
    account = Account(id=new_id("a"), name=name, token_hash=token_hash(token), created_at=now)
    session.add(account)
    session.flush()
    return account, token


def authenticate(session: Session, token: str) -> Account:
    account = session.scalars(select(Account).where(Account.token_hash == token_hash(token))).first()
    if account is None:
        raise Unauthorized("unknown API token")
    return account


def deposit(session: Session, account: Account, amount_micro: int, now: float) -> int:
    """Credits bought from outside: WORLD pays the consumer. Returns the new balance."""
    wallet = accounts.consumer(account.id)
    ledger.append(
        session,
        kind="deposit",
        memo=f"deposit by {account.name}",
        postings=[(accounts.WORLD, -amount_micro), (wallet, amount_micro)],
        now=now,
    )
    return ledger.balance(session, wallet)
