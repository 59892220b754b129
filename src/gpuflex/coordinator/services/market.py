"""The market: offers, and which online node runs each pending task of a job, and why.

The ranking itself is the pure ``gpuflex.market.matching`` (shared with the simulator); this
module turns database rows into offers, each with its node's reputation (``gpuflex.market.reputation``,
counted here in two aggregate queries for all nodes at once) and the hours it has left on offer, and
records each choice with its reason (on the task and in the job's log). A task that waits keeps why on
its task, node by node (``gpuflex.market.waiting``: busy with which job, barred, short of stake, or
the requirement it fails), and the job's log is told when that changes. A job that has not started
waits, placing nothing, until its aggregator and ``min_workers`` workers can be placed together
(``market.placement``); after that it takes what it can. A node runs one task at a time: a node
holding a live lease, or chosen for a pending task, is busy. A node whose availability ran out gets
no new task, and a task placed on it but not yet leased goes back. An auction job's workers are placed
by its auction (``gpuflex.market.pricing``), whose clearing price is kept on the job: later
replacements must ask no more than it, and its workers' leases are metered at it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Job, JobEvent, Lease, Node, Task, Verdict, refresh_statistics, try_lock
from gpuflex.coordinator.services import federated, governance, ledger, liveness, registry, specs, timings
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import BadRequest
from gpuflex.ledger import accounts
from gpuflex.market import quotes, reputation
from gpuflex.market.index import OfferIndex
from gpuflex.market.matching import NodeOffer, Requirements
from gpuflex.market.placement import place_job, start_size, unstaked
from gpuflex.market.waiting import Held, Waiting, busy_with, why_waiting
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits, to_micro
from gpuflex.protocol.spec import JobSpec

OPEN_JOB_STATES = ("pending", "scheduled", "starting", "running")
_PLACEMENT_LOCK_KEY = 0x6770_6C63  # "gplc"


def lease_ends(session: Session, node_ids: Sequence[str] | None = None) -> dict[str, Counter]:
    """How many leases of each node are in each state (``active`` included), in one query."""
    query = select(Lease.node_id, Lease.state, func.count()).group_by(Lease.node_id, Lease.state)
    if node_ids is not None:
        query = query.where(Lease.node_id.in_(node_ids))
    ends: dict[str, Counter] = defaultdict(Counter)
    for node_id, state, count in session.execute(query):
        ends[node_id][state] += count
    return ends


def reliabilities(
    nodes: Sequence[Node], ends: dict[str, Counter], now: float, heartbeat_interval_s: float
) -> dict[str, float]:
    """Each node's reputation score, by node id; ``ends`` is ``lease_ends`` of (at least) these nodes."""
    return {
        n.id: reputation.score(
            reputation.Record.of(
                heartbeats=n.heartbeats,
                present_s=registry.presence_s(n, now),
                heartbeat_interval_s=heartbeat_interval_s,
                lease_ends=ends.get(n.id, {}),
                audits_passed=n.audits_passed,
                audits_failed=n.audits_failed,
            )
        )
        for n in nodes
    }


def offer_of(node: Node, now: float, reliability: float) -> NodeOffer:
    gpus = tuple(g["name"] for g in node.hardware.get("gpus", []))
    return NodeOffer(
        node_id=node.id,
        name=node.name,
        kind=node.kind,
        price_per_hour=to_credits(node.price_micro),
        tflops=node.tflops,
        vram_gb=node.vram_gb,
        gpus=gpus,
        region=node.region,
        reliability=reliability,
        hours_left=registry.hours_left(node, now),
        kernels=tuple(node.hardware.get("kernels", [])),
    )


def listing(session: Session, now: float, heartbeat_interval_s: float) -> list[m.Offer]:
    """Every node as the market lists it (the query language picks and sorts: ``market.query``)."""
    nodes = registry.all_nodes(session)
    scores = reliabilities(nodes, lease_ends(session), now, heartbeat_interval_s)
    out = []
    for node in nodes:
        offer = offer_of(node, now, scores[node.id])
        out.append(
            m.Offer(
                node_id=node.id,
                name=node.name,
                kind=node.kind,
                device=node.hardware.get("device", "cpu"),
                gpu=offer.gpus[0] if offer.gpus else None,
                vram_gb=node.vram_gb,
                tflops=node.tflops,
                price_per_hour=offer.price_per_hour,
                region=node.region,
                state=node.state,
                reliability=offer.reliability,
                hours=offer.hours_left,
            )
        )
    return out


def busy_nodes(session: Session) -> dict[str, Held]:
    """The nodes that hold a live lease or have a task placed on them, each with the role it is busy with."""
    leased = select(Lease.node_id, Task.role).join(Task, Task.id == Lease.task_id)
    placed = select(Task.node_id, Task.role).where(Task.state == "pending", Task.node_id.is_not(None))
    busy = {}
    for how, query in (("placed", placed), ("leased", leased.where(Lease.state == "active"))):
        for node, role in session.execute(query):
            busy[node] = busy_with(how, role)
    return busy


BARRED = Held("barred", "barred from this job by a guilty verdict")


def barred_nodes(session: Session, job_ids: Sequence[str]) -> dict[str, set[str]]:
    """The nodes a guilty verdict bars from each of these jobs: job id -> node ids."""
    query = select(Verdict.job_id, Verdict.node_id).where(Verdict.guilty, Verdict.job_id.in_(job_ids))
    barred: dict[str, set[str]] = defaultdict(set)
    for job_id, node_id in session.execute(query.distinct()):
        barred[job_id].add(node_id)
    return barred


def _offers(
    session: Session, settings: CoordinatorSettings, now: float, interval_s: float
) -> tuple[list[NodeOffer], dict[str, Held]]:
    """Every online node as an offer, and the nodes that take no new task and why: busy, or a community
    node short of the stake that ``min_stake`` (a governed parameter) asks."""
    online = registry.online(session)
    scores = reliabilities(online, lease_ends(session, [n.id for n in online]), now, interval_s)
    offers = [offer_of(n, now, scores[n.id]) for n in online]
    min_stake = to_micro(governance.parameter(session, "min_stake", settings, now))
    held = {}
    if min_stake > 0:  # else nobody is short, and the stakes need no reading
        held = unstaked(offers, ledger.balances_under(session, accounts.STAKES), min_stake)
    return offers, held | busy_nodes(session)


def quote(
    session: Session, spec: JobSpec, settings: CoordinatorSettings, now: float, heartbeat_interval_s: float
) -> m.Quote:
    """What ``spec`` would cost and take on the online nodes, placed as the market would now; when it
    cannot be placed, why, node by node."""
    if spec.data.federated is not None:
        raise BadRequest(
            "a federated job is not quoted: it runs on its data's owners, whoever they are when it is "
            "submitted (`gpuflex job show` lists them)"
        )
    offers, held = _offers(session, settings, now, heartbeat_interval_s)
    return m.Quote.model_validate(asdict(quotes.quote(spec, offers, held, timings.recent(session))))


def unplace_from_gone_nodes(session: Session, now: float) -> None:
    """A task placed on a node that went away, or whose availability ran out, before leasing it goes
    back to the market."""
    gone = select(Node.id).where(
        or_(Node.state != "online", Node.available_until <= now)  # NULL (open-ended) is never <= now
    )
    session.execute(
        update(Task)
        .where(Task.state == "pending", Task.node_id.in_(gone))
        .values(node_id=None, placement="")
        .execution_options(synchronize_session=False)
    )


def place_pending(session: Session, settings: CoordinatorSettings, now: float) -> int:
    """Place every unplaced pending task on a free, qualifying node; returns how many were placed.

    A community node qualifies only with the stake that ``min_stake`` (a governed parameter) asks;
    core nodes are the operator's own and stake nothing.

    Placement reads the whole market, so one coordinator replica places at a time; another that
    finds the lock taken skips its turn (the holder is placing the same tasks).
    """
    if not try_lock(session, _PLACEMENT_LOCK_KEY):
        return 0
    unplace_from_gone_nodes(session, now)
    unplaced = list(
        session.scalars(
            select(Task)
            .join(Job, Job.id == Task.job_id)
            .where(Task.state == "pending", Task.node_id.is_(None), Job.state.in_(OPEN_JOB_STATES))
            .order_by(Job.created_at, Task.role, Task.index)
        )
    )
    if not unplaced:
        return 0
    offers, held = _offers(session, settings, now, liveness.rules(session, settings, now).interval_s)
    index = OfferIndex(offers)  # ranked once for the pass, not once per job
    job_ids = list(dict.fromkeys(t.job_id for t in unplaced))
    # one query each for all the jobs: a pass over a hundred waiting jobs runs every reaper pass
    jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(job_ids)))}
    on_core = _workers_on_core(session, job_ids)
    barred = barred_nodes(session, job_ids)
    placed = 0
    for job_id in job_ids:
        job, tasks = jobs[job_id], [t for t in unplaced if t.job_id == job_id]
        barred_here = barred.get(job_id, set())
        placed += _place_job_tasks(session, job, tasks, index, held, barred_here, on_core.get(job_id, 0), now)
    if placed >= ANALYZE_AFTER_PLACING:
        refresh_statistics(session, Task)
    return placed


# A pass that places this many tasks refreshes the planner's statistics of ``tasks``. Until autovacuum
# does, PostgreSQL believes pending tasks are as rare as they were (on a new table it guesses so), and a
# lease batch's read and claim of the tasks placed on its nodes scan every pending task through the state
# index (EXPLAIN: 2,975 of 3,000 rows read and dropped). In storms of 3,000 nodes the claim took 1.46-1.61
# ms a batch on the server (its statement log), 0.67-0.79 ms with this.
ANALYZE_AFTER_PLACING = 500


def _place_job_tasks(
    session: Session,
    job: Job,
    tasks: list[Task],
    index: OfferIndex,
    held: dict[str, Held],
    barred: set[str],
    core_already: int,
    now: float,
) -> int:
    """Decide with ``market.placement.place_job`` (shared with the simulator) and write it down; tell
    each task that still waits why.

    ``held``: the nodes that take no new task, and why (busy ones, which this marks as it places);
    ``barred``: the nodes a verdict barred from this job, as good as busy for it; ``core_already``:
    the job's workers on core nodes, which count toward its core quota."""
    spec = specs.load(job)
    if isinstance(spec, JobSpec) and spec.data.federated is not None:
        return federated.place(session, job, spec, tasks, index.offers, held, now)
    req = Requirements.from_spec(spec)
    # a deployment's server replicas are placed as workers are, with no aggregator
    workers = [t for t in tasks if t.role != "aggregator"]
    aggregators = [t for t in tasks if t.role == "aggregator"]
    # placed or leased already (none counted for a deployment scaled up past its first replicas)
    before = max(req.workers - len(workers), 0)
    clearing = None if job.clearing_price_micro is None else to_credits(job.clearing_price_micro)
    decision = place_job(
        req,
        spec.pricing,
        index.offers,
        index=index,
        aggregator=bool(aggregators),
        workers=len(workers),
        busy=held.keys() | barred,
        core_already=core_already,
        clearing_price=clearing,
        gang=start_size(req, started=job.state != "pending", placed=before),
    )
    if decision.clearing_price is not None:
        job.clearing_price_micro = to_micro(decision.clearing_price)
    choices = list(zip(workers, decision.workers.choices, strict=False))
    if decision.aggregator:
        choices.insert(0, (aggregators[0], decision.aggregator))
    for task, choice in choices:
        task.node_id, task.placement = choice.node_id, choice.reason
        held[choice.node_id] = busy_with("placed", task.role)
        session.add(
            JobEvent(
                job_id=job.id,
                at=now,
                message=f"{task.role} {task.index} placed on {choice.node_id}: {choice.reason}",
            )
        )
    waiting = workers[len(decision.workers.choices) :]
    if waiting or (aggregators and not decision.aggregator):
        job_held = {**held, **dict.fromkeys(barred, BARRED)} if barred else held
        why_agg, why_workers = why_waiting(
            index, req, decision, aggregator=bool(aggregators), workers=len(workers), held=job_held
        )
        notes: dict[Waiting, list[Task]] = defaultdict(list)
        for group, why in ((aggregators, why_agg), (waiting, why_workers)):
            if why is not None and group:
                notes[why] += group
        for why, group in notes.items():
            _note_waiting(session, job.id, group, why, now)
    has_aggregator = decision.aggregator is not None or not aggregators
    gang = has_aggregator and before + len(decision.workers.choices) >= req.start_workers
    if job.state == "pending" and choices and gang:
        job.state = "scheduled"  # its aggregator and min_workers workers are placed: it starts
    return len(choices)


def _workers_on_core(session: Session, job_ids: list[str]) -> dict[str, int]:
    """Per job, its workers placed on or leased by core nodes (absent: none)."""
    query = (
        select(Task.job_id, func.count(Task.id))
        .join(Node, Node.id == Task.node_id)
        .where(
            Task.job_id.in_(job_ids),
            Task.role == "worker",
            Task.state.in_(("pending", "leased")),
            Node.kind == "core",
        )
        .group_by(Task.job_id)
    )
    return dict(session.execute(query).all())


def _note_waiting(session: Session, job_id: str, waiting: list[Task], reason: Waiting, now: float) -> None:
    """Keep on each waiting task why it waits (``gpuflex job show``) and tell the job's log when what is
    short changes: placement runs on every reaper pass, and the log needs the news once. The nodes
    named change more often (at scale, their counts every pass): the task keeps them current."""
    note = f"waits: {reason}"
    news = any(not t.placement.startswith(f"waits: {reason.headline}: ") for t in waiting)
    for task in (t for t in waiting if t.placement != note):
        task.placement = note
    if news:
        session.add(JobEvent(job_id=job_id, at=now, message=f"{_who(waiting)}: {reason}"))


def _who(tasks: list[Task]) -> str:
    """``worker 2 waits``, ``aggregator 0 and workers 0, 1 wait``."""
    by_role: dict[str, list[str]] = defaultdict(list)
    for task in tasks:
        by_role[task.role].append(str(task.index))
    named = [f"{role}{'s' if len(i) > 1 else ''} {', '.join(i)}" for role, i in by_role.items()]
    return " and ".join(named) + (" waits" if len(tasks) == 1 else " wait")
