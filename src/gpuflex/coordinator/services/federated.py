"""Federated jobs in the database: their owners at submit, their workers tied to them, and their view.

A job with ``data.federated: NAME`` gets, at submit, one worker task per online owner of NAME that admits
the job's account (``market.federated.choose_owners``; the job's log keeps why each node was or was not
used), and its spec's ``resources.workers`` becomes that count. Each worker task carries its owner's
node (``home_node_id``), the manifest hash its owner announced (``owner_dataset``: the worker checks its
local data against it) and the owner's train tokens (``owner_tokens``: its FedAvg weight, which the
aggregator's config carries). Placement puts such a task on its owner only; a lost owner's task waits
for it while the rounds go on with the others (``resources.min_workers``). Nothing of the data itself is
ever here: only names, counts and hashes.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Account, Job, JobEvent, Node, Task, new_id
from gpuflex.coordinator.services import registry
from gpuflex.errors import BadRequest
from gpuflex.market.federated import (
    OfferedDataset,
    OwnerNode,
    Owners,
    choose_owners,
    home_reason,
    waiting_reason,
)
from gpuflex.market.matching import NodeOffer, Requirements, place_aggregator
from gpuflex.market.waiting import Held, busy_with
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits
from gpuflex.protocol.spec import JobSpec


def owner_node(node: Node) -> OwnerNode:
    return OwnerNode(
        node_id=node.id,
        name=node.name,
        datasets=tuple(OfferedDataset(**d) for d in node.private_data or []),
        consumers=frozenset(node.consumers or []),
        price_per_hour=to_credits(node.price_micro),
        region=node.region,
    )


def owners(session: Session, spec: JobSpec, account: Account) -> Owners:
    """The online owners ``spec``'s job would train on; BadRequest when it has none, or fewer than its
    ``resources.min_workers``."""
    assert spec.data.federated is not None, "only a federated job has owners"
    nodes = [owner_node(n) for n in registry.online(session)]
    found = choose_owners(
        spec.data.federated, account.name, nodes, spec.max_price_per_hour, spec.resources.region
    )
    need = spec.resources.min_workers
    if need is not None and need > len(found.used):
        raise BadRequest(
            f"data.federated: resources.min_workers is {need}, and only {len(found.used)} online owner(s) of "
            f"{spec.data.federated!r} admit account {account.name!r}"
        )
    return found


def with_owners(spec: JobSpec, found: Owners) -> JobSpec:
    """``spec`` as the job runs it: one worker per owner (``resources.workers`` is ignored)."""
    resources = spec.resources.model_copy(update={"workers": len(found.used)})
    return spec.model_copy(update={"resources": resources})


def add_tasks(session: Session, job: Job, found: Owners, now: float) -> None:
    """The job's aggregator and one worker per owner, tied to it; the log says why each node was used or
    not."""
    session.add(Task(id=new_id("t"), job_id=job.id, role="aggregator", index=0, state="pending"))
    for i, owner in enumerate(found.used):
        session.add(
            Task(
                id=new_id("t"),
                job_id=job.id,
                role="worker",
                index=i,
                state="pending",
                home_node_id=owner.node_id,
                owner_dataset=owner.dataset.manifest,
                owner_tokens=owner.dataset.tokens,
            )
        )
    for reason in found.reasons:
        session.add(JobEvent(job_id=job.id, at=now, message=f"owner {reason}"))


def place(
    session: Session,
    job: Job,
    spec: JobSpec,
    tasks: list[Task],
    offers: list[NodeOffer],
    held: dict[str, Held],
    now: float,
) -> int:
    """Place the aggregator on a core node and each worker on its owner, if free (not ``held``); until the
    job has started, only once its aggregator and ``min_workers`` workers can go together. Marks the
    nodes it places on in ``held``; returns how many were placed; each task left waits with why. (No
    node is ever barred from a federated job: it has no verifier to convict one.)"""
    req = Requirements.from_spec(spec)
    workers = [t for t in tasks if t.role == "worker"]
    aggregators = [t for t in tasks if t.role == "aggregator"]
    homes = {t.home_node_id for t in workers}
    chosen, waits = _workers(session, spec, workers, {o.node_id: o for o in offers}, held)
    agg = place_aggregator(req, offers, exclude=held.keys() | homes) if aggregators else None
    if agg is not None:
        chosen.insert(0, (aggregators[0], agg.node_id, agg.reason))
    elif aggregators:
        waits.append((aggregators[0], "waits: no free core node qualifies for the aggregator"))
    before = req.workers - len(workers)  # placed or leased already
    placed_workers = len(chosen) - (agg is not None)
    if job.state == "pending" and (
        (aggregators and agg is None) or before + placed_workers < req.start_workers
    ):
        waits += [(t, "waits: the job starts once its aggregator and min_workers owners can run together")
                  for t, _, _ in chosen]  # fmt: skip
        chosen = []
    for task, node_id, reason in chosen:
        task.node_id, task.placement = node_id, reason
        held[node_id] = busy_with("placed", task.role)
        message = f"{task.role} {task.index} placed on {node_id}: {reason}"
        session.add(JobEvent(job_id=job.id, at=now, message=message))
    for task, reason in waits:
        if task.placement != reason:  # placement runs every reaper pass: the log hears of a change once
            task.placement = reason
            session.add(JobEvent(job_id=job.id, at=now, message=f"{task.role} {task.index} {reason}"))
    if job.state == "pending" and chosen:
        job.state = "scheduled"
    return len(chosen)


def _workers(
    session: Session, spec: JobSpec, workers: list[Task], online: dict[str, NodeOffer], held: dict[str, Held]
) -> tuple[list[tuple[Task, str, str]], list[tuple[Task, str]]]:
    """Each worker on its owner, as (task, node, reason), or why it waits: its owner is not online, no
    longer offers the dataset it announced, or is busy."""
    dataset = spec.data.federated or ""
    home = _homes(session, {t.home_node_id for t in workers})
    chosen, waits = [], []
    for task in workers:
        node_id = task.home_node_id or ""
        name, announced = home.get(node_id, (node_id, set()))
        if node_id not in online:
            waits.append((task, waiting_reason(name, "not online")))
        elif (dataset, task.owner_dataset) not in announced:
            waits.append((task, waiting_reason(name, f"it no longer offers {dataset} as it did")))
        elif node_id in held:
            waits.append((task, waiting_reason(name, held[node_id].reason)))
        else:
            chosen.append((task, node_id, home_reason(name, dataset, task.owner_tokens or 0)))
    return chosen, waits


def _homes(session: Session, node_ids: set[str | None]) -> dict[str, tuple[str, set[tuple[str, str]]]]:
    """Each of these nodes' name, and what it offers now as (dataset name, manifest hash): a node that
    registered again without a worker's dataset, or with other data under its name, would only fail that
    worker."""
    query = select(Node.id, Node.name, Node.private_data).where(Node.id.in_([n for n in node_ids if n]))
    return {
        node_id: (name, {(d["name"], d["manifest"]) for d in data or []})
        for node_id, name, data in session.execute(query)
    }


def weights(session: Session, job_id: str) -> dict[str, int]:
    """Each worker task's FedAvg weight: its owner's train tokens (what the aggregator's config carries)."""
    rows = session.execute(
        select(Task.id, Task.owner_tokens).where(Task.job_id == job_id, Task.owner_tokens.is_not(None))
    )
    return {task_id: tokens for task_id, tokens in rows}


def owners_of(session: Session, job: Job, spec: JobSpec) -> list[m.FederatedOwner]:
    """A federated job's owners, as ``gpuflex job show`` lists them (empty for any other job)."""
    if spec.data.federated is None:
        return []
    rows = session.execute(
        select(Task.id, Task.owner_tokens, Node.id, Node.name)
        .join(Node, Node.id == Task.home_node_id)
        .where(Task.job_id == job.id)
        .order_by(Task.index)
    )
    return [
        m.FederatedOwner(
            node_id=node_id, name=name, dataset=spec.data.federated, tokens=tokens or 0, task_id=task_id
        )
        for task_id, tokens, node_id, name in rows
    ]
