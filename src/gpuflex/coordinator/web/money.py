"""Money as the ledger and provider pages show it: your balances and entries, network totals, the chain.

A viewer sees the entries that touch their own accounts (a consumer: its wallet and its jobs'
escrows; a provider: its earnings account) and network-wide totals, never another consumer's lines.
The whole journal is still re-verified on every view (``verify_chain``, signatures included), so the
status is real.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import AccountBalance, Job, Lease, Node, Task
from gpuflex.coordinator.services import leases, ledger, payouts
from gpuflex.ledger import accounts
from gpuflex.ledger.journal import ChainReport, verify_chain

ENTRIES_SHOWN = 50


@dataclass(frozen=True)
class BalanceRow:
    account: str
    label: str
    micro: int


@dataclass(frozen=True)
class EntryRow:
    seq: int
    at: str
    kind: str
    memo: str
    change: int  # micro-credits in or out of the viewer's main account (wallet, or earnings)


@dataclass(frozen=True)
class LedgerView:
    chain: ChainReport
    balances: list[BalanceRow]
    entries: list[EntryRow]  # newest first
    totals: dict[str, int]  # network-wide, micro-credits

    @property
    def main(self) -> BalanceRow:
        return self.balances[0]


@dataclass(frozen=True)
class LeaseRow:
    lease_id: str
    job_id: str
    role: str
    epoch: int
    state: str
    granted_at: float
    seconds: float
    cost: int


@dataclass(frozen=True)
class JobEarning:
    job_id: str
    seconds: float
    metered: int  # what its leases cost the consumer so far
    paid: int  # what settlement set aside for this node (metered less the platform fee)


@dataclass(frozen=True)
class Earnings:
    node: Node
    balance: int
    held: int  # settled, waiting for audit windows to pass
    leases: list[LeaseRow]
    jobs: list[JobEarning]
    ledger: LedgerView

    @property
    def metered(self) -> int:
        return sum(j.metered for j in self.jobs)

    @property
    def unpaid(self) -> int:
        """Metered on jobs not settled yet (settled jobs paid it, less the platform fee)."""
        return sum(j.metered for j in self.jobs if not j.paid)


def _totals(session: Session) -> dict[str, int]:
    def total(prefix: str) -> int:
        like = select(func.coalesce(func.sum(AccountBalance.balance), 0))
        return int(session.scalar(like.where(AccountBalance.account.like(f"{prefix}%"))))

    return {
        "money in the network": -ledger.balance(session, accounts.WORLD),
        "consumer wallets": total("consumer:"),
        "in escrow": total("escrow:"),
        "held in audit windows": total(accounts.HELD),
        "paid to providers": total("provider:"),
        "platform fees": ledger.balance(session, accounts.PLATFORM_FEES),
    }


def ledger_view(session: Session, mine: dict[str, str]) -> LedgerView:
    """``mine``: the viewer's accounts and how to label them, the main one (wallet, earnings) first."""
    journal = ledger.entries(session)
    main = next(iter(mine))
    rows = []
    for e in reversed(journal):
        change = sum(n for a, n in e.postings if a == main)
        if any(a in mine for a, _ in e.postings):
            rows.append(EntryRow(e.seq, e.at, e.kind, e.memo, change))
        if len(rows) == ENTRIES_SHOWN:
            break
    balances = [BalanceRow(a, label, ledger.balance(session, a)) for a, label in mine.items()]
    return LedgerView(
        chain=verify_chain(journal, public_key=ledger.public_key(session)),
        balances=[b for b in balances if b.micro or b.account == main],
        entries=rows,
        totals=_totals(session),
    )


def consumer_accounts(session: Session, account_id: str) -> dict[str, str]:
    mine = {accounts.consumer(account_id): "your wallet"}
    for job_id, name in session.execute(select(Job.id, Job.name).where(Job.account_id == account_id)):
        mine[accounts.escrow(job_id)] = f"escrow of {name} ({job_id})"
    return mine


def _lease_rows(session: Session, node: Node, now: float) -> list[LeaseRow]:
    rows = session.execute(
        select(Lease, Task.role)
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.node_id == node.id)
        .order_by(Lease.granted_at.desc())
    )
    out = []
    for lease, role in rows:
        end = lease.ended_at if lease.ended_at is not None else min(now, lease.expires_at)
        seconds = max(0.0, end - lease.granted_at)
        cost = leases.metered_cost(lease, now)
        out.append(
            LeaseRow(lease.id, lease.job_id, role, lease.epoch, lease.state, lease.granted_at, seconds, cost)
        )
    return out


def earnings(session: Session, node: Node, now: float) -> Earnings:
    """A provider's own page: balance, leases, and per job what was metered and what it was paid.

    A job's pay is what its settlement set aside for this node (``held:<job>/<node>``), whether the
    audit window has released it to the node's earnings yet or not.
    """
    account = accounts.provider(node.id)
    lease_rows = _lease_rows(session, node, now)
    seconds: dict[str, float] = defaultdict(float)
    metered: dict[str, int] = defaultdict(int)
    for row in lease_rows:
        seconds[row.job_id] += row.seconds
        metered[row.job_id] += row.cost
    held = {accounts.held(j, node.id): j for j in seconds}
    labels = {account: "your earnings"} | {a: f"held for job {j}" for a, j in held.items()}
    view = ledger_view(session, labels)
    paid: dict[str, int] = defaultdict(int)
    for e in ledger.entries(session):
        for a, n in e.postings:
            if a in held and n > 0:
                paid[held[a]] += n
    per_job = [JobEarning(j, seconds[j], metered[j], paid.get(j, 0)) for j in dict.fromkeys(seconds)]
    held_now = payouts.held_for_node(session, node.id)
    return Earnings(node, ledger.balance(session, account), held_now, lease_rows, per_job, view)
