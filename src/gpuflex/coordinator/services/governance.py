"""Governance: proposals to change a network parameter, stake-weighted votes, tallies, values in force.

The rules (which parameters, their ranges, when a proposal passes) are the pure
``gpuflex.ledger.governance``; this module stores proposals and votes and writes every step (a
proposal, each vote, each tally) to the journal as a ``governance`` entry that moves no money, so
the chain that audits the money also audits how its rules changed.

- A node proposes if its stake is at least ``governance_proposal_stake``; voting stays open for
  ``governance_voting_period_s`` and the change takes effect at the proposal's ``effective_at``,
  which must fall after voting closes (so nobody is surprised by a change still being voted on).
- A vote weighs the voter's stake at the moment it votes; zero stake cannot vote. Votes are final:
  a second vote by the same node on the same proposal is a 409 (a unique constraint backs it).
- The reaper tallies each proposal once its voting closes, against all stake at that moment.
- ``parameter`` is the value in force at ``now``: the passed proposal for it that took effect most
  recently (``effective_at <= now``), else the coordinator's setting. Code that reads a governable
  parameter reads it here, never from the settings.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import AccountBalance, Node, Proposal, Vote, new_id
from gpuflex.coordinator.services import ids, ledger
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.ledger import accounts
from gpuflex.ledger import governance as rules
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits, to_micro


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _iso(t: float) -> str:
    return _when(t).isoformat(timespec="seconds")


def _stake(session: Session, node_id: str) -> int:
    return ledger.balance(session, accounts.stake(node_id))


def total_stake(session: Session) -> int:
    """All stake bonded by all nodes, micro-credits."""
    every_stake = accounts.stake("%")  # "stake:%": a LIKE pattern for every node's stake account
    query = select(func.coalesce(func.sum(AccountBalance.balance), 0))
    return int(session.scalar(query.where(AccountBalance.account.like(every_stake))))  # PostgreSQL: Decimal


def _record(session: Session, memo: str, now: float) -> None:
    ledger.append(session, kind="governance", memo=memo, postings=(), now=now)


def propose(
    session: Session, node: Node, msg: m.ProposalCreate, settings: CoordinatorSettings, now: float
) -> Proposal:
    param = rules.parameter(msg.parameter)
    value = param.check(msg.value)
    need, have = to_micro(settings.governance_proposal_stake), _stake(session, node.id)
    if have <= 0:
        raise Forbidden(f"node {node.id} has no stake: only staked nodes propose")
    if have < need:
        raise Forbidden(
            f"proposing needs {to_credits(need):g} credits of stake; node {node.id} has {to_credits(have):g}"
        )
    closes_at = now + settings.governance_voting_period_s
    effective_at = msg.effective_at.timestamp()
    if effective_at <= closes_at:
        raise BadRequest(
            f"effective_at {_iso(effective_at)} is too early: it must be after voting closes "
            f"at {_iso(closes_at)}"
        )
    proposal = Proposal(
        id=new_id("gp"),
        proposer_id=node.id,
        parameter=param.name,
        value=value,
        reason=msg.reason,
        created_at=now,
        closes_at=closes_at,
        effective_at=effective_at,
        state="open",
    )
    session.add(proposal)
    session.flush()
    _record(
        session,
        f"proposal {proposal.id}: node {node.id} proposes {param.name} = {param.show(value)} "
        f"from {_iso(effective_at)}; voting closes {_iso(closes_at)}; "
        f"reason: {msg.reason}",
        now,
    )
    return proposal


def get(session: Session, proposal_id: str, *, for_update: bool = False) -> Proposal:
    """A proposal by its id or a unique prefix of it."""
    return ids.lookup(session, Proposal, proposal_id, what="proposal", for_update=for_update)


def vote(session: Session, node: Node, proposal_id: str, msg: m.VoteCast, now: float) -> Vote:
    proposal = get(session, proposal_id, for_update=True)  # a tally can't slip between check and vote
    if proposal.state != "open" or now >= proposal.closes_at:
        raise Conflict(f"voting on proposal {proposal.id} closed at {_iso(proposal.closes_at)}")
    weight = _stake(session, node.id)
    if weight <= 0:
        raise Forbidden(f"node {node.id} has no stake: only staked nodes vote")
    if session.scalar(select(Vote.id).where(Vote.proposal_id == proposal.id, Vote.node_id == node.id)):
        raise Conflict(f"node {node.id} already voted on proposal {proposal.id}; votes are final")
    ballot = Vote(proposal_id=proposal.id, node_id=node.id, choice=msg.choice, weight=weight, at=now)
    session.add(ballot)
    param = rules.parameter(proposal.parameter)
    _record(
        session,
        f"vote on proposal {proposal.id} ({param.name} = {param.show(proposal.value)}): node {node.id} "
        f"votes {msg.choice} with a weight of {to_credits(weight):g} credits of stake",
        now,
    )
    return ballot


def votes_open(session: Session, node_id: str) -> bool:
    """Whether the node voted on a proposal still open: its stake weighs in a count not yet made."""
    query = select(Vote.id).join(Proposal, Proposal.id == Vote.proposal_id)
    return session.scalars(query.where(Vote.node_id == node_id, Proposal.state == "open")).first() is not None


def votes(session: Session, proposal: Proposal) -> list[Vote]:
    return list(session.scalars(select(Vote).where(Vote.proposal_id == proposal.id).order_by(Vote.id)))


def tally_of(session: Session, proposal: Proposal, settings: CoordinatorSettings) -> rules.Tally:
    """The proposal's tally: as decided once tallied, else running (against all stake now)."""
    total = proposal.total_stake if proposal.total_stake is not None else total_stake(session)
    ballots = [(v.choice, v.weight) for v in votes(session, proposal)]
    return rules.tally(ballots, total_stake=total, quorum=settings.governance_quorum)


def tally_due(session: Session, settings: CoordinatorSettings, now: float) -> list[Proposal]:
    """Decide every open proposal whose voting has closed (the reaper's duty)."""
    due = select(Proposal).where(Proposal.state == "open", Proposal.closes_at <= now)
    due = due.order_by(Proposal.closes_at, Proposal.id).with_for_update(skip_locked=True)
    decided = list(session.scalars(due))
    for proposal in decided:
        result = tally_of(session, proposal, settings)
        proposal.state = "passed" if result.passed else "rejected"
        proposal.tallied_at, proposal.total_stake = now, result.total_stake
        param = rules.parameter(proposal.parameter)
        quorum = "met" if result.quorum_met else "not met"
        effect = f"in force from {_iso(proposal.effective_at)}" if result.passed else "no change"
        _record(
            session,
            f"proposal {proposal.id} ({param.name} = {param.show(proposal.value)}) {proposal.state}: "
            f"yes {to_credits(result.yes):g}, no {to_credits(result.no):g}, "
            f"abstain {to_credits(result.abstain):g} of {to_credits(result.total_stake):g} credits of stake "
            f"(quorum {float(result.quorum):.0%} {quorum}); {effect}",
            now,
        )
    return decided


def _in_force(session: Session, name: str, now: float) -> Proposal | None:
    """The passed proposal for ``name`` that took effect most recently, if any."""
    query = (
        select(Proposal)
        .where(Proposal.parameter == name, Proposal.state == "passed", Proposal.effective_at <= now)
        .order_by(Proposal.effective_at.desc(), Proposal.created_at.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def _value(name: str, proposal: Proposal | None, settings: CoordinatorSettings | None) -> int | float:
    return rules.parameter(name).type(proposal.value if proposal else getattr(settings, name))


def _proposed(proposal: Proposal) -> int | float:
    return _value(proposal.parameter, proposal, None)


def parameter(session: Session, name: str, settings: CoordinatorSettings, now: float) -> int | float:
    """The value of governable parameter ``name`` in force at ``now``."""
    return _value(name, _in_force(session, name, now), settings)


def platform_fee_bps(session: Session, settings: CoordinatorSettings, now: float) -> int:
    """The platform's fee on a settlement made at ``now``, basis points."""
    return parameter(session, "platform_fee_bps", settings, now)


# -- views ------------------------------------------------------------------------------------


def proposals(session: Session) -> list[Proposal]:
    return list(session.scalars(select(Proposal).order_by(Proposal.created_at.desc(), Proposal.id)))


def info(proposal: Proposal) -> m.ProposalInfo:
    return m.ProposalInfo(
        id=proposal.id,
        proposer=proposal.proposer_id,
        parameter=proposal.parameter,
        value=_proposed(proposal),
        reason=proposal.reason,
        created_at=_when(proposal.created_at),
        closes_at=_when(proposal.closes_at),
        effective_at=_when(proposal.effective_at),
        state=proposal.state,
        tallied_at=_when(proposal.tallied_at) if proposal.tallied_at is not None else None,
    )


def vote_info(v: Vote) -> m.VoteInfo:
    return m.VoteInfo(
        proposal_id=v.proposal_id,
        node_id=v.node_id,
        choice=v.choice,
        weight=to_credits(v.weight),
        at=_when(v.at),
    )


def detail(session: Session, proposal: Proposal, settings: CoordinatorSettings) -> m.ProposalDetail:
    t = tally_of(session, proposal, settings)
    tally = m.TallyInfo(
        yes=to_credits(t.yes),
        no=to_credits(t.no),
        abstain=to_credits(t.abstain),
        total_stake=to_credits(t.total_stake),
        quorum=float(t.quorum),
        quorum_met=t.quorum_met,
        passed=t.passed,
    )
    ballots = [vote_info(v) for v in votes(session, proposal)]
    return m.ProposalDetail(**info(proposal).model_dump(), tally=tally, votes=ballots)


def parameters(session: Session, settings: CoordinatorSettings, now: float) -> list[m.ParameterInfo]:
    """Every governable parameter: its value in force now, where it comes from, and changes to come."""
    scheduled = select(Proposal).where(Proposal.state == "passed", Proposal.effective_at > now)
    coming: dict[str, list[m.ScheduledChange]] = {}
    for p in session.scalars(scheduled.order_by(Proposal.effective_at)):
        change = m.ScheduledChange(proposal_id=p.id, value=_proposed(p), effective_at=_when(p.effective_at))
        coming.setdefault(p.parameter, []).append(change)
    out = []
    for name, param in rules.PARAMETERS.items():
        proposal = _in_force(session, name, now)
        out.append(
            m.ParameterInfo(
                name=name,
                value=_value(name, proposal, settings),
                source=proposal.id if proposal else "setting",
                unit=param.unit,
                minimum=param.minimum,
                maximum=param.maximum,
                description=param.description,
                scheduled=coming.get(name, []),
            )
        )
    return out
