"""The deployments page's view: each of a consumer's deployments with its replicas and the nodes they
run on, what it served over the last minute, its spend, its keys' token earnings and its verdicts.

It takes the account its caller already got from the viewer, so nobody sees another's deployments.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Account, Node, Task
from gpuflex.coordinator.relay import Relay
from gpuflex.coordinator.services import deployment_keys, deployments, verification
from gpuflex.protocol import messages as m


@dataclass(frozen=True)
class Replica:
    index: int
    state: str
    node_id: str | None
    node: str | None  # the node's name
    epoch: int


@dataclass(frozen=True)
class DeploymentRow:
    info: m.DeploymentInfo  # with what this process's relay measured over the last minute
    replicas: list[Replica]
    earned: float  # what its keys' holders owe for tokens, settled or not
    settled: float  # of that, paid into the ledger
    verdicts: list[m.Verdict]


def deployments_page(session: Session, account: Account, relay: Relay, now: float) -> list[DeploymentRow]:
    """The account's deployments, newest first."""
    rows = []
    for deployment in reversed(deployments.list_for(session, account)):
        keys = deployment_keys.of(session, deployment)
        rows.append(
            DeploymentRow(
                info=relay.measured(deployments.info(session, deployment, now)),
                replicas=_replicas(session, deployment.id),
                earned=sum(k.accrued for k in keys),
                settled=sum(k.settled for k in keys),
                verdicts=verification.for_job(session, deployment),
            )
        )
    return rows


def _replicas(session: Session, deployment_id: str) -> list[Replica]:
    query = (
        select(Task, Node.name)
        .outerjoin(Node, Node.id == Task.node_id)
        .where(Task.job_id == deployment_id, Task.state.in_(deployments.LIVE_TASK_STATES))
        .order_by(Task.index)
    )
    return [Replica(t.index, t.state, t.node_id, name, t.epoch) for t, name in session.execute(query)]
