"""API keys scoped to one deployment: what an OpenAI client sends the gateway instead of its owner's
account token, so a key handed to an application reaches that deployment and nothing else.

Only a key's sha256 is kept (as an account token's). Each request served under a key counts on its row
(requests, prompt and completion tokens), added in the database so concurrent requests all count; what
the owner's account token is served counts on the deployment's account-token row (made with the
deployment). Its owner sees them on ``deployment show``.

A key may be made for another account (its holder) at prices per million input and output tokens. Its
secret goes to the holder alone, when it claims the key (``claim``): the owner, who is paid, never holds
a secret that another account pays for. Its usage is never paid per request: the holder pays the owner
in batches (``settle_due``, a reaper duty every ``usage_settle_interval_s``, and ``settle_deployment``
when the deployment stops), one journal entry per key per batch, for the cost of its running totals less
what was settled before. A request is refused with a 402 before it is served unless the holder's wallet
covers what is owed plus the most that request can cost (``ensure_payable``). Requests in flight
together may still owe more than the wallet holds by the time they settle: a batch never takes more
than the wallet has, and the key is refused until the rest is paid.
"""

from __future__ import annotations

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from gpuflex.auth.tokens import new_deployment_key, token_hash
from gpuflex.coordinator.db import Account, DeploymentKey, Job, JobEvent, new_id
from gpuflex.coordinator.services import ledger
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import BadRequest, Conflict, InsufficientFunds, NotFound, Unauthorized
from gpuflex.ledger import accounts
from gpuflex.ledger.metering import token_cost_micro
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import format_credits, to_credits, to_micro

_PRICED = or_(DeploymentKey.price_in_micro > 0, DeploymentKey.price_out_micro > 0)


def create(
    session: Session, deployment: Job, owner: Account, msg: m.DeploymentKeyCreate, now: float
) -> m.DeploymentKeyCreated:
    """A new key of ``deployment`` (``owner``'s, already checked) for ``msg.holder`` at its prices: the
    owner's own with its secret shown this once; another account's without one (it claims it)."""
    if deployment.state not in OPEN_JOB_STATES:
        raise Conflict(f"deployment {deployment.id} has ended ({deployment.state}): it takes no new key")
    holder = owner if msg.holder in (None, owner.name) else _named(session, msg.holder)
    if holder.id == owner.id and (msg.price_in or msg.price_out):
        raise BadRequest(
            "a price is paid by another account: give the key to one (holder, `--for ACCOUNT`), "
            "or leave the price at 0 for your own use"
        )
    secret = new_deployment_key() if holder.id == owner.id else None
    key = _row(deployment, holder, now, to_micro(msg.price_in), to_micro(msg.price_out))
    key.token_hash = None if secret is None else token_hash(secret)
    session.add(key)
    said = f"API key {key.id} created"
    if holder.id != owner.id:
        said += f" for {holder.name} at {msg.price_in:g}/{msg.price_out:g} credits per 1M input/output tokens"
    session.add(JobEvent(job_id=deployment.id, at=now, message=said))
    return _shown(key, holder.name, secret)


def claim(session: Session, account: Account, key_id: str, now: float) -> m.DeploymentKeyCreated:
    """The secret of a key made for ``account``, shown this once; a key made for anyone else is as
    unknown as a missing one."""
    key = session.get(DeploymentKey, key_id, with_for_update=True)
    if key is None or key.account_id != account.id or key.account_token:
        raise NotFound(f"no API key {key_id} made for {account.name}")
    if key.token_hash is not None:
        raise Conflict(f"API key {key.id} was claimed already: its secret is shown once")
    deployment = session.get(Job, key.deployment_id)
    if deployment.state not in OPEN_JOB_STATES:
        raise Conflict(f"deployment {deployment.id} has ended ({deployment.state}): its keys serve nothing")
    secret = new_deployment_key()
    key.token_hash = token_hash(secret)
    session.add(JobEvent(job_id=deployment.id, at=now, message=f"API key {key.id} claimed by {account.name}"))
    return _shown(key, account.name, secret)


def _shown(key: DeploymentKey, holder: str, secret: str | None) -> m.DeploymentKeyCreated:
    return m.DeploymentKeyCreated(
        **usage(key, holder).model_dump(), deployment_id=key.deployment_id, key=secret
    )


def open_account_token_row(session: Session, deployment: Job, now: float) -> None:
    """The row that counts what the owner's account token is served (the gateway's ``count_account``)."""
    row = _row(deployment, None, now)
    row.account_token = True
    session.add(row)


def _row(
    deployment: Job,
    holder: Account | None,
    now: float,
    price_in: int = 0,
    price_out: int = 0,
) -> DeploymentKey:
    return DeploymentKey(
        id=new_id("k"),
        deployment_id=deployment.id,
        account_id=deployment.account_id if holder is None else holder.id,
        token_hash=None,  # the owner's own key's hash is set by ``create``; another's by ``claim``
        account_token=False,
        created_at=now,
        requests=0,
        prompt_tokens=0,
        completion_tokens=0,
        price_in_micro=price_in,
        price_out_micro=price_out,
        settled_micro=0,
        settled_at=now,  # its first batch is one interval after it is made
    )


def _named(session: Session, name: str) -> Account:
    found = session.scalars(select(Account).where(Account.name == name)).first()
    if found is None:
        raise NotFound(f"no account named {name!r} to hold the key")
    return found


def authenticate(session: Session, secret: str) -> DeploymentKey:
    key = session.scalars(select(DeploymentKey).where(DeploymentKey.token_hash == token_hash(secret))).first()
    if key is None:
        raise Unauthorized("unknown API key")
    return key


def count(session: Session, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """One request served under the key."""
    _count(session, DeploymentKey.id == key_id, prompt_tokens, completion_tokens)


def count_account(session: Session, deployment_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """One request served to the deployment's owner under its account token."""
    where = (DeploymentKey.deployment_id == deployment_id) & DeploymentKey.account_token
    _count(session, where, prompt_tokens, completion_tokens)


def _count(session: Session, where, prompt_tokens: int, completion_tokens: int) -> None:
    session.execute(
        update(DeploymentKey)
        .where(where)
        .values(
            requests=DeploymentKey.requests + 1,
            prompt_tokens=DeploymentKey.prompt_tokens + prompt_tokens,
            completion_tokens=DeploymentKey.completion_tokens + completion_tokens,
        )
    )


def accrued(key: DeploymentKey) -> int:
    """What every token served under the key costs at its prices, in micro-credits."""
    return token_cost_micro(key.prompt_tokens, key.completion_tokens, key.price_in_micro, key.price_out_micro)


def ensure_payable(session: Session, key_id: str, context: int) -> None:
    """Refuse (402) a request under a priced key whose holder's wallet does not cover what the key owes
    plus the most one request can cost: the whole context at the dearer of its two prices."""
    key = session.get(DeploymentKey, key_id)
    assert key is not None, "an authenticated key exists"
    if not (key.price_in_micro or key.price_out_micro):
        return
    owed = accrued(key) - key.settled_micro
    most = token_cost_micro(context, 0, max(key.price_in_micro, key.price_out_micro), 0)
    have = ledger.balance(session, accounts.consumer(key.account_id))
    if have < owed + most:
        amounts = (format_credits(to_credits(x)) for x in (have, owed, most))
        raise InsufficientFunds(
            "the wallet that pays for this API key holds {} credits, owes {} for tokens served and a request "
            "may cost up to {}: deposit credits (`gpuflex wallet deposit`)".format(*amounts)
        )


def settle_due(session: Session, now: float, *, interval_s: float) -> int:
    """Pay the owners what priced keys not settled for ``interval_s`` owe; the number of entries made."""
    stale = or_(DeploymentKey.settled_at.is_(None), DeploymentKey.settled_at <= now - interval_s)
    return _settle(session, select(DeploymentKey).where(_PRICED, stale), now)


def settle_deployment(session: Session, deployment: Job, now: float) -> int:
    """Pay the owner what every priced key of ``deployment`` owes now (it is stopping)."""
    return _settle(
        session, select(DeploymentKey).where(_PRICED, DeploymentKey.deployment_id == deployment.id), now
    )


def _settle(session: Session, query, now: float) -> int:
    entries = 0
    for key in session.scalars(query.order_by(DeploymentKey.id)).all():
        if accrued(key) <= key.settled_micro:
            continue  # nothing served since its last batch: not locked, not written
        session.refresh(key, with_for_update=True)  # a batch at a time: two replicas never pay it twice
        due = accrued(key) - key.settled_micro
        if due <= 0:
            continue
        holder = accounts.consumer(key.account_id)
        paid = min(due, ledger.balance(session, holder))  # never past what the wallet holds
        key.settled_at = now
        if paid <= 0:
            continue
        owner = session.get(Job, key.deployment_id).account_id
        memo = (
            f"tokens of API key {key.id} on deployment {key.deployment_id}: "
            f"{key.prompt_tokens} input and {key.completion_tokens} output tokens served to date"
        )
        postings = [(holder, -paid), (accounts.consumer(owner), paid)]
        ledger.append(session, kind="usage", memo=memo, postings=postings, now=now)
        key.settled_micro += paid
        entries += 1
    return entries


def of(session: Session, deployment: Job) -> list[m.KeyUsage]:
    query = (
        select(DeploymentKey, Account.name)
        .join(Account, Account.id == DeploymentKey.account_id)
        .where(DeploymentKey.deployment_id == deployment.id)
    )
    rows = session.execute(query.order_by(DeploymentKey.created_at, DeploymentKey.id))
    return [usage(key, holder) for key, holder in rows]


def usage(key: DeploymentKey, holder: str) -> m.KeyUsage:
    return m.KeyUsage(
        id=key.id,
        created_at=key.created_at,
        requests=key.requests,
        prompt_tokens=key.prompt_tokens,
        completion_tokens=key.completion_tokens,
        holder=holder,
        account_token=key.account_token,
        claimed=key.account_token or key.token_hash is not None,
        price_in=to_credits(key.price_in_micro),
        price_out=to_credits(key.price_out_micro),
        accrued=to_credits(accrued(key)),
        settled=to_credits(key.settled_micro),
    )
