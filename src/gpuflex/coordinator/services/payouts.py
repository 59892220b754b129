"""Payouts: a job's pay is held for an audit window after it ends, then released to the providers.

Settlement (``jobs.finish``) moves each node's metered pay, less the platform fee, into
``held:<job>/<node>``. While the audit window runs, verification can withhold one node's pay
(``withhold``: it goes back to the consumer who paid it). Once the window has passed, the reaper
releases what is still held to ``provider:<node>``, where the provider may withdraw it, in one
journal entry per job. Honest providers wait one window; a cheater's pay never leaves the hold: a
node a guilty verdict barred from the job (even one passed before the job ended, when nothing was
held yet) has its pay withheld at release.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import AccountBalance, Job, JobEvent
from gpuflex.coordinator.services import ledger, market
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.ledger import accounts
from gpuflex.protocol.money import to_credits


def held(session: Session, job_id: str) -> dict[str, int]:
    """Pay still held for a job: node id -> micro-credits (nodes with nothing held are left out)."""
    return ledger.balances_under(session, accounts.held_for_job(job_id))


def _held_by(node_id: str) -> tuple:
    """The ``where`` of a node's held accounts that still hold something."""
    return (
        AccountBalance.account.startswith(accounts.HELD),
        AccountBalance.account.endswith(f"/{node_id}"),
        AccountBalance.balance > 0,
    )


def held_for_node(session: Session, node_id: str) -> int:
    """Everything a node has earned that is still inside an audit window."""
    return sum(session.scalars(select(AccountBalance.balance).where(*_held_by(node_id))))


def held_until(session: Session, node_id: str, *, audit_window_s: float) -> float | None:
    """When the last audit window of the node's held pay ends (None: nothing is held)."""
    held_accounts = session.scalars(select(AccountBalance.account).where(*_held_by(node_id)))
    job_ids = [account.removeprefix(accounts.HELD).partition("/")[0] for account in held_accounts]
    if not job_ids:
        return None
    return session.scalar(select(func.max(Job.finished_at)).where(Job.id.in_(job_ids))) + audit_window_s


def release_due(session: Session, now: float, *, audit_window_s: float) -> list[str]:
    """Release the held pay of every job whose audit window has passed; returns their ids.

    Each job's row is locked (``SKIP LOCKED``), so replicas release each job once.
    """
    due = session.scalars(
        select(Job)
        .where(
            Job.state.not_in(OPEN_JOB_STATES),
            Job.paid_out_at.is_(None),
            Job.finished_at <= now - audit_window_s,
        )
        .order_by(Job.finished_at)
        .with_for_update(skip_locked=True)
    )
    released = []
    for job in due:
        for node_id in sorted(market.barred_nodes(session, [job.id]).get(job.id, ())):
            withhold(session, job, node_id, "barred from the job by a guilty verdict", now)
        pay = held(session, job.id)
        if pay:
            postings = []
            for node_id, amount in sorted(pay.items()):
                postings += [(accounts.held(job.id, node_id), -amount), (accounts.provider(node_id), amount)]
            memo = f"payout of job {job.id} after its audit window"
            ledger.append(session, kind="payout", memo=memo, postings=postings, now=now)
            paid = f"audit window passed: paid {to_credits(sum(pay.values())):.6f} credits"
            session.add(JobEvent(job_id=job.id, at=now, message=paid))
        job.paid_out_at = now
        released.append(job.id)
    return released


def withhold(session: Session, job: Job, node_id: str, reason: str, now: float) -> int:
    """Send a node's held pay for ``job`` back to the job's owner; returns how much (0 if none is held)."""
    amount = held(session, job.id).get(node_id, 0)
    if amount:
        ledger.append(
            session,
            kind="withhold",
            memo=f"pay of {node_id} for job {job.id} withheld: {reason}",
            postings=[(accounts.held(job.id, node_id), -amount), (accounts.consumer(job.account_id), amount)],
            now=now,
        )
        message = f"pay of {node_id} withheld ({to_credits(amount):.6f} credits refunded): {reason}"
        session.add(JobEvent(job_id=job.id, at=now, message=message))
    return amount
