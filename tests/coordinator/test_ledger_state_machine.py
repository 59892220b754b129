"""The ledger's invariants under any sequence of money movements, on its real storage.

A hypothesis state machine drives ``services.ledger.append`` in a real database (SQLite, and
PostgreSQL when reachable) through the life of money: deposits, escrow at submission, settlement
into held pay (the pure ``settle_job``), payouts after the audit window, withdrawals, stakes,
slashes, guilty verdicts (a slash and the node's held pay for the job back to its consumer), and
overdrafts that must be refused without writing anything. After every step: the
accounts sum to zero, the money inside moved only by deposits and withdrawals, no balance but
WORLD is negative, the kept balances are the journal replayed, and the signed chain verifies.
"""

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, func, select

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import AccountBalance, JournalEntry, make_engine, make_sessionmaker
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.services import ledger
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import InsufficientFunds
from gpuflex.ledger import accounts, balances, settle_job, verify_chain
from gpuflex.storage import LocalBlobStore

CONSUMERS = ["alice", "bob"]
NODES = ["n1", "n2", "n3"]
amounts = st.integers(1, 10**9)


class LedgerMachine(RuleBasedStateMachine):
    ctx: CoordinatorContext  # set by the test, one database for all examples

    def __init__(self) -> None:
        super().__init__()
        with self.ctx.tx() as s:
            s.execute(delete(JournalEntry))
            s.execute(delete(AccountBalance))
        self.inside = 0  # deposits minus withdrawals: the money that must be inside
        self.appended = 0
        self.jobs = itertools.count()
        self.open_jobs: dict[str, str] = {}  # job -> its consumer
        self.owners: dict[str, str] = {}  # every job -> its consumer
        self.held: list[tuple[str, str]] = []  # (job, node) whose pay waits for the audit window

    # -- helpers --------------------------------------------------------------------------

    def append(self, kind: str, postings: list[tuple[str, int]]) -> None:
        with self.ctx.tx() as s:
            ledger.append(s, kind=kind, memo=kind, postings=postings, now=self.ctx.now())
        self.appended += 1

    def balance(self, account: str) -> int:
        with self.ctx.tx() as s:
            return ledger.balance(s, account)

    def funded(self, names: list[str]) -> list[str]:
        return [a for a in names if self.balance(a) > 0]

    def draw_amount(self, data, account: str) -> int:
        return data.draw(st.integers(1, self.balance(account)), label=f"amount from {account}")

    # -- rules ----------------------------------------------------------------------------

    @rule(who=st.sampled_from(CONSUMERS), amount=amounts)
    def deposit(self, who, amount):
        self.append("deposit", [(accounts.WORLD, -amount), (accounts.consumer(who), amount)])
        self.inside += amount

    @precondition(lambda self: self.funded([accounts.consumer(c) for c in CONSUMERS]))
    @rule(data=st.data())
    def submit(self, data):
        wallet = data.draw(st.sampled_from(self.funded([accounts.consumer(c) for c in CONSUMERS])))
        job = f"j{next(self.jobs)}"
        amount = self.draw_amount(data, wallet)
        self.append("escrow", [(wallet, -amount), (accounts.escrow(job), amount)])
        self.open_jobs[job] = self.owners[job] = wallet.removeprefix("consumer:")

    @precondition(lambda self: self.open_jobs)
    @rule(data=st.data(), fee_bps=st.sampled_from([0, 1000, 2500]))
    def settle(self, data, fee_bps):
        job = data.draw(st.sampled_from(sorted(self.open_jobs)))
        escrow = accounts.escrow(job)
        nodes = data.draw(st.lists(st.sampled_from(NODES), unique=True, max_size=3))
        metered = st.integers(0, 2 * self.balance(escrow))  # more than the escrow: scaled down
        costs = {accounts.held(job, n): data.draw(metered, label=f"metered {n}") for n in nodes}
        postings = settle_job(
            escrow_balance=self.balance(escrow),
            costs=costs,
            fee_bps=fee_bps,
            consumer_account=accounts.consumer(self.open_jobs.pop(job)),
            escrow_account=escrow,
        )
        self.append("settlement", list(postings))
        self.held += [(job, n) for n in nodes if self.balance(accounts.held(job, n)) > 0]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def payout(self, data):
        job, node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        pay = self.balance(accounts.held(job, node))
        self.append("payout", [(accounts.held(job, node), -pay), (accounts.provider(node), pay)])

    @precondition(lambda self: self.funded(self.spenders()))
    @rule(data=st.data())
    def withdraw(self, data):
        account = data.draw(st.sampled_from(self.funded(self.spenders())))
        amount = self.draw_amount(data, account)
        self.append("withdrawal", [(account, -amount), (accounts.WORLD, amount)])
        self.inside -= amount

    @rule(node=st.sampled_from(NODES), amount=amounts)
    def stake_from_outside(self, node, amount):
        self.append("stake", [(accounts.WORLD, -amount), (accounts.stake(node), amount)])
        self.inside += amount

    @precondition(lambda self: self.funded([accounts.provider(n) for n in NODES]))
    @rule(data=st.data())
    def stake_from_earnings(self, data):
        earnings = data.draw(st.sampled_from(self.funded([accounts.provider(n) for n in NODES])))
        amount = self.draw_amount(data, earnings)
        node = earnings.removeprefix("provider:")
        self.append("stake", [(earnings, -amount), (accounts.stake(node), amount)])

    @precondition(lambda self: self.funded([accounts.stake(n) for n in NODES]))
    @rule(data=st.data())
    def slash(self, data):
        stake = data.draw(st.sampled_from(self.funded([accounts.stake(n) for n in NODES])))
        amount = self.draw_amount(data, stake)
        self.append("slash", [(stake, -amount), (accounts.SLASHED, amount)])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), slash=amounts)
    def guilty_verdict(self, data, slash):
        """What ``services.verification`` moves for a guilty verdict: stake (what there is of it) to
        ``platform:slashed``, and the node's held pay for the job back to the job's consumer."""
        job, node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        taken = min(slash, self.balance(accounts.stake(node)))
        if taken:
            self.append("slash", [(accounts.stake(node), -taken), (accounts.SLASHED, taken)])
        pay = self.balance(accounts.held(job, node))
        refund = accounts.consumer(self.owners[job])
        self.append("withhold", [(accounts.held(job, node), -pay), (refund, pay)])

    @rule(data=st.data(), extra=amounts)
    def overdraft_is_refused_and_writes_nothing(self, data, extra):
        everyone = [*self.spenders(), *(accounts.stake(n) for n in NODES)]
        account = data.draw(st.sampled_from([*everyone, *(accounts.escrow(j) for j in self.open_jobs)]))
        amount = self.balance(account) + extra
        with self.ctx.tx() as s:
            before = _stored(s)
            with pytest.raises(InsufficientFunds, match=account):
                postings = [(account, -amount), (accounts.escrow("elsewhere"), amount)]
                ledger.append(s, kind="transfer", memo="overdraft", postings=postings, now=self.ctx.now())
            assert _stored(s) == before

    def spenders(self) -> list[str]:
        return [*(accounts.consumer(c) for c in CONSUMERS), *(accounts.provider(n) for n in NODES)]

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def money_is_conserved_and_the_signed_chain_verifies(self):
        with self.ctx.tx() as s:
            count, kept = _stored(s)
            journal = ledger.entries(s)
        assert count == self.appended
        assert sum(kept.values()) == 0
        assert -kept.get(accounts.WORLD, 0) == self.inside
        assert all(n >= 0 for a, n in kept.items() if a != accounts.WORLD), kept
        assert _nonzero(kept) == _nonzero(balances(journal))
        report = verify_chain(journal, public_key=self.ctx.ledger_key.public_key_hex)
        assert report.ok, report.problem
        assert report.entries == self.appended


def _stored(s) -> tuple[int, dict[str, int]]:
    """What the database holds: the number of journal entries and every balance row."""
    count = s.scalar(select(func.count()).select_from(JournalEntry))
    return count, {row.account: row.balance for row in s.scalars(select(AccountBalance))}


def _nonzero(bal: dict[str, int]) -> dict[str, int]:
    return {a: n for a, n in bal.items() if n}


def test_ledger_invariants_hold_under_any_sequence_of_operations(database_url, tmp_path):
    upgrade(database_url)
    engine = make_engine(database_url)
    settings_ = CoordinatorSettings(data_dir=tmp_path, database_url=database_url)
    ctx = CoordinatorContext(settings_, engine, make_sessionmaker(engine), LocalBlobStore(tmp_path / "blobs"))
    machine = type("Machine", (LedgerMachine,), {"ctx": ctx})
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=20,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        engine.dispose()
