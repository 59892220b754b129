"""Audits of a deployment's served requests: the draw, who checks them, and what a finding entails.

A request a replica served is drawn for audit with the deployment's ``audit_rate`` (a CSPRNG draw when
its completion reaches the gateway: the provider can neither predict nor re-roll it), and what the
replica claimed is kept: prompt and output token ids, sampling (temperature, top_p, seed) and one
fingerprint per 32 output tokens. Not drawn: requests served by a core node (trusted) and requests
resumed after a failover (their first tokens came from another replica, which this one cannot answer for).

Auditors claim pending audits with their node's signature (``claim``): a core node any audit; a community
node, only while no core node is online, the audits of a deployment it holds a replica of, served by a
replica on another node. It re-runs the prefill of prompt + output on its own copy of the model
(``serve.verify``) and posts its finding (``judge``), signed too. A claim not judged within ``CLAIM_S``
goes to the next auditor that asks.

A community auditor is itself a provider, so its failed finding convicts no one alone: it is an
accusation (state ``referee``) that only a core node may claim next. If the core node's check fails too,
the provider is convicted, with both findings as evidence; if it passes, the accuser is (it framed an
honest replica, or serves so differently that its findings cannot be trusted). Until a core node comes
online, the accused replica goes on serving: a false accusation costs the network an audit, not an
honest provider its stake.

A failed audit is a verdict like training's (``verification.convict``): the provider is slashed the
deployment's ``slash`` credits (its held pay withheld), its failed audits count against its reputation,
its lease on the replica ends and the replica is placed again, never on that node
(``market.barred_nodes``). One verdict per node and deployment: the node's other failed audits are kept
as failed, not slashed again. A passed audit counts for the node's reputation. Neither bills the
request's key: an audit is the network's cost, not the caller's.
"""

from __future__ import annotations

import base64

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import InferenceAudit, Job, JobEvent, Lease, Node, Task, Verdict
from gpuflex.coordinator.services import specs, verification
from gpuflex.coordinator.services.deployments import KIND, ROLE
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_micro
from gpuflex.serve.engine import Completion

CHECK = "inference-audit"
CLAIM_S = 300.0  # a claimed audit not judged within this goes to the next auditor


def sample(session: Session, deployment_id: str, lease_id: str, done: Completion, now: float) -> bool:
    """Record an audit of the request ``lease_id`` served, if it is drawn; True when it was."""
    deployment = session.get(Job, deployment_id)
    if deployment is None or not verification.drawn(specs.deployment(deployment).audit_rate):
        return False
    lease = session.get(Lease, lease_id)
    if lease is None or done.usage.resumed_tokens or session.get(Node, lease.node_id).kind == "core":
        return False
    assert done.params.seed is not None, "a served completion reports its seed"
    session.add(
        InferenceAudit(
            job_id=deployment_id,
            task_id=lease.task_id,
            lease_id=lease.id,
            node_id=lease.node_id,
            prompt=list(done.prompt),
            tokens=list(done.tokens),
            params={
                "temperature": done.params.temperature,
                "top_p": done.params.top_p,
                "seed": done.params.seed,
            },
            fingerprints=[base64.b64encode(f).decode() for f in done.fingerprints],
            state="pending",
            reason="",
            numbers={},
            created_at=now,
        )
    )
    return True


def claim(session: Session, node: Node, limit: int, now: float) -> m.InferenceAuditList:
    """Hand ``node`` up to ``limit`` pending audits it may judge (see the module's rules), oldest first
    (``InferenceAuditClaim`` bounds ``limit``)."""
    claimable = ("pending", "referee") if node.kind == "core" else ("pending",)
    scope = [
        InferenceAudit.state.in_(claimable),
        InferenceAudit.node_id != node.id,
        (InferenceAudit.auditor_node_id.is_(None))
        | (InferenceAudit.auditor_node_id == node.id)
        | (InferenceAudit.claimed_at < now - CLAIM_S),
        Job.state.in_(OPEN_JOB_STATES),
    ]
    if node.kind != "core":
        core_online = select(Node.id).where(Node.state == "online", Node.kind == "core").limit(1)
        if session.scalars(core_online).first() is not None:
            return m.InferenceAuditList(audits=[])
        serving = select(Lease.job_id).join(Task, Task.id == Lease.task_id)
        serving = serving.where(Lease.node_id == node.id, Lease.state == "active", Task.role == ROLE)
        scope.append(InferenceAudit.job_id.in_(serving))
    query = (
        select(InferenceAudit)
        .join(Job, Job.id == InferenceAudit.job_id)
        .where(*scope, Job.kind == KIND)
        .order_by(InferenceAudit.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=InferenceAudit)
    )
    rows = list(session.scalars(query))
    deployments = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_({r.job_id for r in rows})))}
    for row in rows:
        row.auditor_node_id, row.claimed_at = node.id, now
    return m.InferenceAuditList(audits=[_view(row, deployments[row.job_id]) for row in rows])


def _view(row: InferenceAudit, deployment: Job) -> m.InferenceAudit:
    spec = specs.deployment(deployment)
    return m.InferenceAudit(
        id=row.id,
        deployment_id=row.job_id,
        model=spec.model,
        dtype=spec.dtype,
        prompt=row.prompt,
        tokens=row.tokens,
        temperature=row.params["temperature"],
        top_p=row.params["top_p"],
        seed=row.params["seed"],
        fingerprints=row.fingerprints,
    )


def judge(session: Session, auditor: Node, audit_id: int, finding: m.InferenceFinding, now: float) -> None:
    """Take the auditor's finding on an audit it claimed; a failed one convicts the provider (once per
    deployment). The same finding again is a no-op; another one is a 409."""
    row = session.get(InferenceAudit, audit_id, with_for_update=True)
    if row is None:
        raise NotFound(f"no inference audit {audit_id}")
    if row.accuser_node_id == auditor.id and not finding.ok:
        return  # its accusation again (a retry): it stands, for a core node to referee
    if row.auditor_node_id != auditor.id:
        raise Forbidden(f"inference audit {audit_id} is not claimed by this node: claim it first")
    state = "passed" if finding.ok else "failed"
    if row.state not in ("pending", "referee"):
        if row.state != state:
            raise Conflict(f"inference audit {audit_id} was already judged {row.state}")
        return
    if not finding.ok and auditor.kind != "core":
        _accuse(session, row, auditor, finding, now)
        return
    accuser = session.get(Node, row.accuser_node_id) if row.state == "referee" else None
    row.state, row.reason, row.numbers, row.judged_at = state, finding.reason, dict(finding.numbers), now
    node = session.get(Node, row.node_id, with_for_update=True)
    if finding.ok:
        node.audits_passed += 1
        if accuser is not None:
            reason = (
                f"its failed finding on audit {row.id} of {node.name}'s replica ({row.accusation['reason']}) "
                f"did not hold: a core node's check passed ({finding.reason})"
            )
            _convict(session, row, accuser, _accuser_task(session, row), reason, finding, auditor, now)
        return
    _convict(session, row, node, row.task_id, finding.reason, finding, auditor, now)


def _accuse(
    session: Session, row: InferenceAudit, accuser: Node, finding: m.InferenceFinding, now: float
) -> None:
    """A community auditor's failed finding: kept, and the audit waits for a core node to referee it."""
    row.state, row.accuser_node_id, row.auditor_node_id, row.claimed_at = "referee", accuser.id, None, None
    row.accusation = {"reason": finding.reason, "numbers": dict(finding.numbers)}
    message = (
        f"audit {row.id}: {accuser.name} ({accuser.id}) found {row.node_id}'s replica failing "
        f"({finding.reason}); a community auditor convicts no one alone: a core node referees it"
    )
    session.add(JobEvent(job_id=row.job_id, at=now, message=message))


def _accuser_task(session: Session, row: InferenceAudit) -> str:
    """The accuser's replica task on the deployment (its newest lease's): a community auditor serves one."""
    query = select(Lease.task_id).where(Lease.job_id == row.job_id, Lease.node_id == row.accuser_node_id)
    return session.scalars(query.order_by(Lease.granted_at.desc()).limit(1)).one()


def _convict(
    session: Session,
    row: InferenceAudit,
    node: Node,
    task_id: str,
    reason: str,
    finding: m.InferenceFinding,
    auditor: Node,
    now: float,
) -> None:
    """A verdict on ``node`` for audit ``row``, once per node and deployment (a node barred already is not
    slashed again); the evidence is the deciding finding's numbers, and the accusation's if there was one."""
    convicted = select(Verdict.id).where(
        Verdict.job_id == row.job_id, Verdict.node_id == node.id, Verdict.guilty
    )
    if session.scalars(convicted).first() is not None:
        return
    deployment = session.get(Job, row.job_id, with_for_update=True)
    evidence = dict(list(finding.numbers.items())[: verification.EVIDENCE_ITEMS - 3])
    evidence |= {"audit": row.id, "auditor": auditor.id}
    if row.accuser_node_id is not None:
        evidence["accuser"] = row.accuser_node_id
    verdict = Verdict(
        job_id=row.job_id,
        round=row.id,
        task_id=task_id,
        node_id=node.id,
        guilty=True,
        check=CHECK,
        reason=reason,
        evidence=evidence,
        slashed_micro=0,
        withheld_micro=0,
        at=now,
    )
    amount = to_micro(specs.deployment(deployment).slash)
    verification.convict(session, deployment, task_id, node, verdict, amount, f"audit {row.id}", now)
    session.add(verdict)
