"""A provider node's money: its stake, its earnings, withdrawals, and slashing by verdict.

A community node must bond at least ``min_stake`` credits (``stake:<node>``) before the market
gives it work, so cheating costs more than it can earn. The stake backs the node's work while it
can still be audited: it cannot be unstaked while the node holds a lease or has pay held in an
audit window, nor while it weighs in a vote still open (moved to another node, it would vote
twice). A verdict (``slash``) takes stake to ``platform:slashed`` and can withhold the node's held
pay for the job in question. Earnings (``provider:<node>``) can be withdrawn or staked.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, Lease, Node, Slash, new_id
from gpuflex.coordinator.services import governance, ids, ledger, payouts
from gpuflex.errors import BadRequest, Conflict
from gpuflex.ledger import accounts
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits


def wallet(session: Session, node: Node) -> m.NodeWallet:
    slashed = session.scalar(select(func.sum(Slash.amount_micro)).where(Slash.node_id == node.id))
    return m.NodeWallet(
        node_id=node.id,
        earnings=to_credits(ledger.balance(session, accounts.provider(node.id))),
        held=to_credits(payouts.held_for_node(session, node.id)),
        stake=to_credits(ledger.balance(session, accounts.stake(node.id))),
        slashed=to_credits(slashed or 0),
    )


def stake(session: Session, node: Node, amount_micro: int, source: m.StakeSource, now: float) -> None:
    """Bond credits: paid in from outside (``deposit``) or taken from the node's own earnings."""
    payer = accounts.WORLD if source == "deposit" else accounts.provider(node.id)
    ledger.append(
        session,
        kind="stake",
        memo=f"{node.name} ({node.id}) stakes from its {source}",
        postings=[(payer, -amount_micro), (accounts.stake(node.id), amount_micro)],
        now=now,
    )


def unstake(session: Session, node: Node, amount_micro: int, now: float, *, audit_window_s: float) -> None:
    """Return stake to the node's earnings, once none of its work can still be audited."""
    if session.scalars(select(Lease.id).where(Lease.node_id == node.id, Lease.state == "active")).first():
        raise Conflict("the node holds a lease: its stake backs that work; unstake when it is idle")
    held_until = payouts.held_until(session, node.id, audit_window_s=audit_window_s)
    if held_until is not None:
        ends = datetime.fromtimestamp(held_until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        raise Conflict(
            f"the node has pay held in an audit window until {ends} ({_from_now(held_until - now)}): "
            "its stake backs that work until then; unstake after it"
        )
    if governance.votes_open(session, node.id):
        raise Conflict("the node's stake counts in a vote still open: unstake when the vote closes")
    ledger.append(
        session,
        kind="unstake",
        memo=f"{node.name} ({node.id}) unstakes",
        postings=[(accounts.stake(node.id), -amount_micro), (accounts.provider(node.id), amount_micro)],
        now=now,
    )


def _from_now(seconds: float) -> str:
    if seconds <= 0:
        return "over: the pay is released at the next reaper pass"
    if seconds < 120:
        return f"in {seconds:.0f} s"
    return f"in {seconds / 60:.0f} min" if seconds < 7200 else f"in {seconds / 3600:.1f} h"


def withdraw(session: Session, node: Node, amount_micro: int, now: float) -> None:
    """Pay earnings out of the network (to a bank account, in a real deployment)."""
    ledger.append(
        session,
        kind="withdrawal",
        memo=f"{node.name} ({node.id}) withdraws its earnings",
        postings=[(accounts.provider(node.id), -amount_micro), (accounts.WORLD, amount_micro)],
        now=now,
    )


def slash(
    session: Session, node_id: str, amount_micro: int, evidence: str, now: float, *, job_id: str | None = None
) -> Slash:
    """Take up to ``amount_micro`` of a node's stake for a verdict, and with ``job_id`` its held pay too.

    The stake may hold less than the verdict asks: what is there is taken, and the record says so.
    """
    node_id = ids.lookup(session, Node, node_id, what="node").id
    if not evidence.strip():
        raise BadRequest("a slash needs its evidence: say what the node did and how it was found")
    job = ids.lookup(session, Job, job_id, what="job") if job_id else None
    taken = min(amount_micro, ledger.balance(session, accounts.stake(node_id)))
    if taken:
        ledger.append(
            session,
            kind="slash",
            memo=f"{node_id} slashed: {evidence}",
            postings=[(accounts.stake(node_id), -taken), (accounts.SLASHED, taken)],
            now=now,
        )
    withheld = payouts.withhold(session, job, node_id, f"slashed: {evidence}", now) if job else 0
    record = Slash(
        id=new_id("s"),
        node_id=node_id,
        job_id=job.id if job else None,
        amount_micro=taken,
        withheld_micro=withheld,
        evidence=evidence,
        at=now,
    )
    session.add(record)
    return record


def slashes(session: Session) -> list[Slash]:
    return list(session.scalars(select(Slash).order_by(Slash.at.desc(), Slash.id)))
