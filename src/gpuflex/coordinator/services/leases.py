"""Leases: a task runs on one node at a time, under an epoch that fences out stale holders.

Granting is a compare-and-set on the task row (``pending`` -> ``leased``, epoch + 1), so two
coordinator replicas can never hand the same task out twice. Heartbeats renew a lease; one not
renewed before it expires is ended and its task goes back to the market. A report or a task
request carrying an older epoch changes nothing and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import Row, bindparam, case, exists, insert, select, tuple_, update
from sqlalchemy.orm import Session

from gpuflex.auth.tokens import new_task_token, token_hash
from gpuflex.coordinator.db import Job, JobEvent, Lease, Node, Task, new_id
from gpuflex.coordinator.services import dp, federated, market, secure, specs
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import Conflict, Forbidden, NotFound, Unauthorized
from gpuflex.ledger.metering import lease_cost_micro
from gpuflex.market.liveness import Liveness, lease_expires_at
from gpuflex.market.pricing import lease_price
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.messages import LeaseGrant, LeaseHeld, LeaseReport, ServerConfig, TaskConfig
from gpuflex.protocol.spec import JobSpec


def metered_cost(lease: Lease, now: float) -> int:
    """What a lease has cost so far: per second, up to its end or its last renewal."""
    until = lease.ended_at if lease.ended_at is not None else min(now, lease.expires_at)
    return lease_cost_micro(max(0.0, until - lease.granted_at), lease.price_micro)


def _price_micro(task: Row, node: Row) -> int:
    """What a lease is metered at: the node's own price, or its job's auction clearing price for a worker."""
    return lease_price(task.role, node.price_micro, task.clearing_price_micro)


def _event(session: Session, job_id: str, now: float, message: str) -> None:
    session.add(JobEvent(job_id=job_id, at=now, message=message))


# what ``grant`` reads of a node (``registry.nodes`` loads rows of these)
GRANT_READS = (Node.state, Node.available_until, Node.price_micro, Node.name)


def grant(
    session: Session,
    nodes: Sequence[Row],
    settings: CoordinatorSettings,
    rules: Liveness,
    now: float,
    *,
    may_place: Callable[[], bool] = lambda: True,
) -> list[LeaseGrant | None]:
    """For each node, in order, a lease on the next task placed on it, or None: it holds a lease already,
    nothing is placed on it, or (a node asking twice at once) its first request took the task. A lease
    lives ``rules.lease_ttl_s`` unrenewed.

    With nothing placed on some of them, one placement pass runs first if ``may_place()`` (a replica
    throttles them). One statement per kind of row for all the nodes.
    """
    asking = list({n.id: n for n in nodes}.values())
    on_offer = [
        n.id for n in asking if n.state == "online" and (n.available_until is None or n.available_until > now)
    ]
    placed = _placed_on(session, on_offer)
    idle = [n.id for n in asking if n.id not in placed]
    if idle and may_place():  # place what is pending (this unplaces work from gone nodes)
        market.place_pending(session, settings, now)
        placed |= _placed_on(session, idle)
    epochs = _claim(session, list(placed.values()))  # another replica may have taken some first
    claimed = {node_id: task for node_id, task in placed.items() if task.id in epochs}
    job_specs = _start_jobs(session, claimed.values())
    weights = _federated_weights(session, claimed.values(), job_specs)
    expires_at = lease_expires_at(now, rules.lease_ttl_s(settings.lease_ttl_s))
    grants, rows, events = {}, [], []
    for node in asking:
        if (task := claimed.get(node.id)) is not None:
            spec = job_specs[task.job_id]
            lease, grant = _lease(node, task, epochs[task.id], spec, now, expires_at, weights.get(task.id))
            grants[node.id] = grant
            rows.append(lease)
            message = f"{task.role} {task.index} leased to {node.name} ({node.id}), epoch {grant.epoch}"
            events.append({"job_id": task.job_id, "at": now, "message": message})
    if rows:  # Core bulk inserts: no ORM bookkeeping per row
        session.connection().execute(_INSERT_LEASES, rows)
        session.connection().execute(_INSERT_EVENTS, events)
    return [grants.pop(node.id, None) for node in nodes]  # a node named twice: its first answer has it


_INSERT_LEASES, _INSERT_EVENTS = insert(Lease.__table__), insert(JobEvent.__table__)


def _placed_on(session: Session, node_ids: Sequence[str]) -> dict[str, Row]:
    """The task placed on each of ``node_ids`` that holds no lease, not yet leased, with what a grant
    needs of its job; the task locked (PostgreSQL: ``SKIP LOCKED``, so a grant never queues behind another
    replica's grant of the same task; it finds nothing)."""
    if not node_ids:
        return {}
    placed: dict[str, Row] = {}
    for task in session.execute(_PLACED, {"nodes": list(node_ids)}):
        placed.setdefault(task.node_id, task)
    return placed


# Rows, not ORM objects: the batch only reads them. The job's columns come along (a statement fewer per
# batch); its spec, which never changes, from ``specs``. ORM-enabled: the session flushes what it holds
# first (a job a placement pass just scheduled, its auction's clearing price).
_PLACED = (
    select(Task.id, Task.job_id, Task.role, Task.index, Task.epoch, Task.node_id, Task.owner_dataset)
    .add_columns(Job.state.label("job_state"), Job.dataset, Job.recipe_code, Job.clearing_price_micro)
    .join(Job, Job.id == Task.job_id)
    .where(Task.node_id.in_(bindparam("nodes", expanding=True)), Task.state == "pending")
    .where(~exists().where(Lease.node_id == Task.node_id, Lease.state == "active"))
    .order_by(Task.node_id, Task.role)
    .with_for_update(of=Task, skip_locked=True)
)


_TASKS = Task.__table__
_CLAIM = (
    update(_TASKS)
    .where(tuple_(_TASKS.c.id, _TASKS.c.epoch).in_(bindparam("as_read", expanding=True)))
    .where(_TASKS.c.state == "pending")
    .values(state="leased", epoch=_TASKS.c.epoch + 1)
    .returning(_TASKS.c.id, _TASKS.c.epoch)
)


def _claim(session: Session, tasks: Sequence[Row]) -> dict[str, int]:
    """Compare-and-set ``pending`` -> ``leased``, epoch + 1, on every task still as read; returns the
    new epoch of each task claimed."""
    if not tasks:
        return {}
    as_read = sorted((t.id, t.epoch) for t in tasks)
    return dict(session.connection().execute(_CLAIM, {"as_read": as_read}).all())


def _start_jobs(session: Session, tasks: Iterable[Row]) -> dict[str, specs.Spec]:
    """The specs of the jobs of the tasks being leased (read only for a job this process has not seen);
    each job now runs, a deployment starts (it runs once a replica answers: ``deployments.ready``)."""
    states = {task.job_id: task.job_state for task in tasks}
    if starting := sorted(job for job, state in states.items() if state in ("pending", "scheduled")):
        session.execute(_RUN, {"jobs": starting})
    found = {job_id: spec for job_id in states if (spec := specs.SPECS.get(job_id)) is not None}
    if unseen := sorted(states.keys() - found.keys()):
        found |= {job.id: specs.load(job) for job in session.execute(_SPECS, {"jobs": unseen})}
    return found


_RUN = (
    update(Job)
    .where(Job.id.in_(bindparam("jobs", expanding=True)))
    .values(state=case((Job.kind == "deployment", "starting"), else_="running"))
)
_SPECS = select(Job.id, Job.spec, Job.kind).where(Job.id.in_(bindparam("jobs", expanding=True)))


def _federated_weights(
    session: Session, tasks: Iterable[Row], job_specs: dict[str, specs.Spec]
) -> dict[str, dict[str, int]]:
    """For each federated job's aggregator being leased (by task id), its workers' FedAvg weights; under
    secure aggregation for its workers too (each masks its share of the average: ``train.secure``)."""
    return {
        t.id: federated.weights(session, t.job_id)
        for t in tasks
        if isinstance(spec := job_specs[t.job_id], JobSpec)
        and spec.data.federated is not None
        and (t.role == "aggregator" or spec.privacy.secure_aggregation)
    }


def _lease(
    node: Row,
    task: Row,
    epoch: int,
    spec: specs.Spec,
    now: float,
    expires_at: float,
    weights: dict[str, int] | None = None,
) -> tuple[dict, LeaseGrant]:
    """The row of a claimed task's lease (``task`` a row of ``_PLACED``), and its grant with the task token
    only its holder learns; ``weights``: a federated job's aggregator's."""
    token = new_task_token()
    lease = {
        "id": new_id("l"),
        "task_id": task.id,
        "job_id": task.job_id,
        "node_id": node.id,
        "epoch": epoch,
        "token_hash": token_hash(token),
        "state": "active",
        "granted_at": now,
        "renewed_at": now,
        "expires_at": expires_at,
        "price_micro": _price_micro(task, node),
        "cost_micro": 0,
    }
    grant = LeaseGrant(
        lease_id=lease["id"],
        task_id=task.id,
        job_id=task.job_id,
        role=task.role,
        epoch=epoch,
        expires_at=expires_at,
        task_token=token,
        task=_task_config(task, spec, weights),
    )
    return lease, grant


def _task_config(task: Row, spec: specs.Spec, weights: dict[str, int] | None) -> TaskConfig | ServerConfig:
    """What the task's process is handed: a training task's config, or a deployment replica's."""
    if isinstance(spec, DeploymentSpec):
        return ServerConfig(
            job_id=task.job_id,
            task_id=task.id,
            replica=task.index,
            model=spec.model,
            context=spec.context,
            max_batch=spec.max_batch,
            dtype=spec.dtype,
        )
    return TaskConfig(
        job_id=task.job_id,
        task_id=task.id,
        role=task.role,
        worker_index=task.index,
        num_workers=spec.resources.workers,
        training=spec.training,
        dataset=task.owner_dataset or task.dataset,  # a federated worker's: its owner's manifest
        prepared=spec.data.prepared is not None,
        recipe_code=task.recipe_code,
        federated=spec.data.federated,
        weights=weights,
        dp=dp.task(spec),
        encrypted=spec.privacy.encrypt,
        secure_aggregation=secure.threshold(spec),
    )


_RENEW = (
    update(Lease.__table__)
    .where(Lease.__table__.c.id == bindparam("lease"), Lease.__table__.c.state == "active")
    .values(renewed_at=bindparam("now"), expires_at=bindparam("expires"))
)


def work_waiting(session: Session, node_ids: Sequence[str]) -> set[str]:
    """The nodes among ``node_ids`` with a task placed on them and not yet leased: their heartbeat tells
    them to ask for it, so idle agents need not poll for work (a thousand idle agents polling each
    second made lease requests, and the placement pass each ran, the coordinator's bottleneck)."""
    return set(session.scalars(_WORK_WAITING, {"nodes": list(set(node_ids))}))


# Statements every heartbeat batch runs, built once: building one (its IN list, its cache key) cost
# about as much as running it (py-spy on the heartbeat writer).
_WORK_WAITING = (
    select(Task.node_id)
    .where(Task.state == "pending", Task.node_id.in_(bindparam("nodes", expanding=True)))
    .distinct()
)
_HELD = select(Lease.id, Lease.node_id, Lease.epoch, Lease.state).where(
    Lease.id.in_(bindparam("leases", expanding=True))
)


def renew(
    session: Session,
    held: Sequence[tuple[str, Sequence[LeaseHeld]]],
    settings: CoordinatorSettings,
    rules: Liveness,
    now: float,
) -> list[list[str]]:
    """Extend the live leases each node holds (a batch of heartbeats, as (node id, leases held));
    return, for each, the leases it must stop (ended, stale or not its own). One read, one write."""
    wanted = {h.lease_id for _, leases in held for h in leases}
    known = {row.id: row for row in session.execute(_HELD, {"leases": list(wanted)})} if wanted else {}
    revoked: list[list[str]] = []
    renewed = set()
    for node_id, leases in held:
        stop = []
        for h in leases:
            lease = known.get(h.lease_id)
            if lease is None or (lease.node_id, lease.epoch, lease.state) != (node_id, h.epoch, "active"):
                stop.append(h.lease_id)
            else:
                renewed.add(h.lease_id)
        revoked.append(stop)
    if renewed:
        expires = lease_expires_at(now, rules.lease_ttl_s(settings.lease_ttl_s))
        rows = [{"lease": lease, "now": now, "expires": expires} for lease in sorted(renewed)]
        session.connection().execute(_RENEW, rows)
    return revoked


def _end(lease: Lease, state: str, at: float) -> None:
    lease.state = state
    lease.ended_at = at
    lease.cost_micro = lease_cost_micro(max(0.0, at - lease.granted_at), lease.price_micro)


def _return_task(session: Session, lease: Lease, now: float, why: str, *, failed: bool = False) -> None:
    """Hand the task back to the market, unless a newer lease holds it (compare-and-set on the epoch)."""
    session.execute(
        update(Task)
        .where(Task.id == lease.task_id, Task.state == "leased", Task.epoch == lease.epoch)
        .values(state="pending", node_id=None, placement="", failures=Task.failures + int(failed))
        .execution_options(synchronize_session=False)
    )
    task = session.get(Task, lease.task_id, populate_existing=True)
    _event(session, lease.job_id, now, f"{task.role} {task.index} on {lease.node_id} {why}; re-leasing")


def _live(session: Session, *where, order=Lease.id, limit: int | None = None) -> list[Lease]:
    """Active leases matching ``where``, locked; a lease another replica is ending right now is skipped."""
    query = select(Lease).where(Lease.state == "active", *where).order_by(order, Lease.id).limit(limit)
    return list(session.scalars(query.with_for_update(skip_locked=True)))


def expire(session: Session, now: float, *, limit: int | None = None) -> list[Lease]:
    """End leases past their expiry (at most ``limit``, the oldest first); metered up to their last
    renewal. Their tasks go back."""
    expired = _live(session, Lease.expires_at < now, order=Lease.expires_at, limit=limit)
    for lease in expired:
        _end(lease, "expired", lease.renewed_at)
        _return_task(session, lease, now, f"missed its lease (epoch {lease.epoch})")
    return expired


def expire_for_node(session: Session, node_id: str, now: float, why: str) -> list[Lease]:
    """End a node's leases now (it was lost, or registered again after a restart): its tasks go back."""
    ended = _live(session, Lease.node_id == node_id)
    for lease in ended:
        _end(lease, "expired", lease.renewed_at)
        _return_task(session, lease, now, why)
    return ended


def end_by_verdict(session: Session, task_id: str, node_id: str, now: float) -> Lease | None:
    """End a convicted node's live lease on the task, if it holds one; the task goes back to the market
    (which never places it on that node again: ``market.barred_nodes``)."""
    ended = _live(session, Lease.task_id == task_id, Lease.node_id == node_id)
    for lease in ended:
        _end(lease, "excluded", now)
        _return_task(session, lease, now, "was found cheating")
    return ended[0] if ended else None


def cancel_task(session: Session, task: Task, now: float) -> None:
    """Cancel one task of a job that goes on (a deployment scaled down): its live lease, if any, ends now
    (the holder learns it on its next heartbeat) and the task is never placed again."""
    for lease in _live(session, Lease.task_id == task.id):
        _end(lease, "completed", now)
    task.state = "cancelled"
    _event(session, task.job_id, now, f"{task.role} {task.index} cancelled")


def end_for_job(session: Session, job: Job, now: float, task_state: str) -> None:
    """Close a finished job's live leases and tasks (the holders learn it on their next heartbeat).

    A task that never held a lease never ran: it ends ``unplaced``, whatever the job's end, and keeps
    why (the last reason it waited, or the node it was placed on too late)."""
    for lease in session.scalars(select(Lease).where(Lease.job_id == job.id, Lease.state == "active")):
        _end(lease, "completed", now)
    never = select(Task).where(Task.job_id == job.id, Task.state == "pending", Task.epoch == 0)
    for task in session.scalars(never):
        task.state, task.placement = "unplaced", _never_ran(task)
    session.flush()
    session.execute(
        update(Task)
        .where(Task.job_id == job.id, Task.state.in_(("pending", "leased")))
        .values(state=task_state)
    )


def _never_ran(task: Task) -> str:
    if task.node_id is not None:
        return f"never ran: placed on {task.node_id}, not leased before the job ended"
    why = task.placement.removeprefix("waits: ")
    return f"never placed: {why}" if why else "never placed"


def report(session: Session, node: Node, lease_id: str, msg: LeaseReport, now: float) -> None:
    """A node says how its lease ended. Stale epochs and other nodes' leases change nothing."""
    lease = session.get(Lease, lease_id, with_for_update=True)
    if lease is None:
        raise NotFound(f"no lease {lease_id}")
    if lease.node_id != node.id:
        raise Forbidden("this lease belongs to another node")
    if msg.epoch != lease.epoch:
        raise Conflict(f"stale epoch {msg.epoch}: lease {lease_id} has epoch {lease.epoch}")
    if lease.state != "active":
        if lease.state == "completed" and msg.outcome == "completed":
            return  # the job finished first and closed the lease; the node's word agrees
        raise Conflict(f"lease {lease_id} has already ended ({lease.state}); the report changes nothing")
    if msg.outcome == "completed":
        # A task subprocess only ends by itself once its job is over; until then it is handed back.
        _end(lease, "released", now)
        _return_task(session, lease, now, "stopped before the job ended")
    else:
        _end(lease, msg.outcome, now)
        detail = f": {msg.detail[-300:]}" if msg.detail else ""
        _return_task(session, lease, now, f"{msg.outcome}{detail}", failed=msg.outcome == "failed")


def authenticate_task(session: Session, token: str, now: float) -> Lease:
    """The lease behind a task token, if it is still live."""
    lease = session.scalars(select(Lease).where(Lease.token_hash == token_hash(token))).first()
    if lease is None:
        raise Unauthorized("unknown task token")
    if lease.state != "active" and not (lease.state == "completed" and _job_done(session, lease)):
        raise Conflict(f"lease {lease.id} has ended ({lease.state}); this task must stop")
    return lease


def _job_done(session: Session, lease: Lease) -> bool:
    return session.get(Job, lease.job_id).state not in market.OPEN_JOB_STATES
