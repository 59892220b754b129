"""Accounts and wallets of consumers."""

from fastapi import APIRouter

from gpuflex.coordinator.auth import Anonymous, Consumer, Ctx
from gpuflex.coordinator.routes import errors
from gpuflex.coordinator.services import accounts, ledger
from gpuflex.errors import Forbidden
from gpuflex.ledger.accounts import consumer
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits, to_micro

router = APIRouter(tags=["accounts"])


@router.post("/accounts", status_code=201, dependencies=[Anonymous], responses=errors(409))
def create_account(body: m.AccountCreate, ctx: Ctx) -> m.AccountCreated:
    """Sign up; the only unauthenticated call, and only while the operator allows open sign-up."""
    if not ctx.settings.open_signup:
        raise Forbidden("sign-up is closed on this coordinator; ask its operator for an account")
    with ctx.tx() as s:
        account, token = accounts.create(s, body.name, ctx.now())
    return m.AccountCreated(account_id=account.id, name=account.name, token=token)


@router.get("/accounts/me")
def me(account: Consumer, ctx: Ctx) -> m.AccountInfo:
    """Who this token belongs to, and the wallet's balance (``gpuflex whoami``)."""
    with ctx.tx() as s:
        balance = ledger.balance(s, consumer(account.id))
    return m.AccountInfo(account_id=account.id, name=account.name, balance=to_credits(balance))


@router.get("/wallet")
def wallet(account: Consumer, ctx: Ctx) -> m.Balance:
    with ctx.tx() as s:
        balance = ledger.balance(s, consumer(account.id))
    return m.Balance(account=account.name, balance=to_credits(balance))


@router.post("/wallet/deposit")
def deposit(body: m.Deposit, account: Consumer, ctx: Ctx) -> m.Balance:
    with ctx.tx() as s:
        balance = accounts.deposit(s, account, to_micro(body.amount), ctx.now())
    return m.Balance(account=account.name, balance=to_credits(balance))
