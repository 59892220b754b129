"""Deployments: a model served by ``server`` replicas on the network, a sibling of a job.

A deployment is a ``jobs`` row of kind ``deployment`` with one ``server`` task per replica, so it reuses
what a job has: placement (``market``, the replicas placed as workers with no aggregator), leases,
epochs and liveness (a lost replica's task goes back to the market and is placed again), per-second
metering from escrow, settlement (``jobs.finish``) and verdicts (its inference audits' failures:
``inference_audits``). It has no rounds and ends when its
owner stops it (what is unspent goes back to the wallet) or its budget is spent (``jobs.enforce_limits``).
``scale`` adds replicas or cancels the newest; its spec's ``replicas`` stays what it was created with.
A leased replica is not live until it answers: it tells what it does meanwhile (``report_phase``:
downloading, loading the model) and its first poll of the relay, which it makes once its model is
loaded, makes it live (``ready``); the deployment is ``starting`` from its first lease until then, and
``running`` after.
What it serves is counted per API key (``deployment_keys``), its owner's account token on a row of its own.
"""

from __future__ import annotations

from pathlib import PurePath

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Account, InferenceAudit, Job, JobEvent, Lease, Task, new_id
from gpuflex.coordinator.services import deployment_keys, ids, jobs, leases, specs, verification
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import BadRequest, Conflict
from gpuflex.market.pricing import parameter_count
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeployedModel, DeploymentSpec
from gpuflex.protocol.money import to_credits, to_micro
from gpuflex.protocol.relay import ReplicaPhase
from gpuflex.protocol.spec import ModelSize
from gpuflex.storage import BlobStore

KIND = "deployment"
ROLE = "server"
LIVE_TASK_STATES = ("pending", "leased")  # a replica asked for: placed, waiting, or running
SERVING = "serving"  # a lease's phase once its replica polls the relay: it answers requests
DOING = {"": "starting on its node", "downloading": "downloading the model", "loading": "loading the model"}


def create(session: Session, account: Account, msg: m.DeploymentCreate, blobs: BlobStore, now: float) -> Job:
    """A deployment with its budget in escrow and one pending server task per replica."""
    spec = _admit(session, account, msg, blobs, stored=True)
    deployment = Job(
        id=new_id("d"),
        account_id=account.id,
        kind=KIND,
        name=spec.name,
        spec=spec.model_dump(mode="json"),
        state="pending",
        reason="",
        created_at=now,
        budget_micro=to_micro(spec.budget),
        round=-1,
    )
    jobs.escrow(session, account, deployment, now)
    _add_replicas(session, deployment, range(spec.replicas))
    deployment_keys.open_account_token_row(session, deployment, now)
    message = f"created by {account.name}; budget in escrow"
    session.add(JobEvent(job_id=deployment.id, at=now, message=message))
    return deployment


def check(session: Session, account: Account, msg: m.DeploymentCreate, blobs: BlobStore) -> None:
    """Refuse now what ``create`` would refuse of ``msg`` once its model directory is uploaded, writing
    nothing: the model it names and a wallet short of its budget. The CLI asks it before uploading."""
    _admit(session, account, msg, blobs, stored=False)
    jobs.covers(session, account, to_micro(msg.spec.budget))


def _admit(
    session: Session, account: Account, msg: m.DeploymentCreate, blobs: BlobStore, *, stored: bool
) -> DeploymentSpec:
    """The spec to create: a training job's model pinned, or a model directory checked (``stored``: its
    blobs in the store; else sized, before its upload)."""
    spec = msg.spec
    if spec.model.job is not None:
        return spec.model_copy(update={"model": _pin_job(session, account, spec.model)})
    jobs.check_uploaded_model(spec.model.uploaded, spec.model.size, blobs, "model.from", stored=stored)
    return spec


def _pin_job(session: Session, account: Account, model: DeployedModel) -> DeployedModel:
    """A deployment of a training job serves that job's newest checkpoint as it is now, sized by its spec."""
    assert model.job is not None, "only a model given by job is pinned"
    job = jobs.owned(session, account, model.job)
    training = specs.of(job).training
    if training.recipe != "hf-causal-lm":
        raise BadRequest(
            f"model.job: job {job.id} trains recipe {training.recipe}, which is not a transformers model; "
            "only hf-causal-lm jobs are served"
        )
    if training.model.from_ is None:
        raise BadRequest(
            f"model.job: job {job.id} trained a model from scratch; only a job that tuned a model directory "
            "(training.model.from) has one to serve (its checkpoint over that directory)"
        )
    if specs.of(job).privacy.encrypt:
        raise BadRequest(
            f"model.job: job {job.id} is encrypted (privacy.encrypt): its checkpoint and model directory "
            "open only with its data key, which no replica is sealed; fetch it with `gpuflex job fetch`"
        )
    if job.checkpoint is None:
        raise Conflict(f"model.job: job {job.id} has no checkpoint yet ({job.state})")
    size = training.model.size
    if size is None:
        parameters = parameter_count(training)
        assert parameters is not None, "an hf-causal-lm model's size follows from its shape"
        shape = training.model
        size = ModelSize(
            parameters=parameters, trainable=parameters, layers=shape.n_layer, hidden=shape.n_embd
        )
    pinned = {"job": job.id, "checkpoint": job.checkpoint, "training": training, "size": size}
    return model.model_copy(update=pinned)


def _add_replicas(session: Session, deployment: Job, indexes: range) -> None:
    for i in indexes:
        session.add(Task(id=new_id("t"), job_id=deployment.id, role=ROLE, index=i, state="pending"))


def owned(session: Session, account: Account, deployment_id: str) -> Job:
    """The deployment, if it is this account's, by its name (as `deploy --name` gave it, and as the API's
    ``model`` takes it), its id or a unique prefix of it; anyone else's is as unknown as a missing one. A
    name several deployments share is an error listing their ids, unless only one of them is open."""
    scope = jobs.mine(account, KIND)
    named = list(
        session.scalars(select(Job).where(*scope, Job.name == deployment_id).order_by(Job.created_at))
    )
    named = [d for d in named if d.state in OPEN_JOB_STATES] or named
    if len(named) == 1:
        return named[0]
    if named:
        raise Conflict(
            f"deployment name {deployment_id} is ambiguous: {ids.listed(named)} are named so; give an id"
        )
    return ids.lookup(session, Job, deployment_id, *scope, what="deployment")


def list_for(session: Session, account: Account) -> list[Job]:
    return jobs.list_for(session, account, KIND)


def servable(session: Session, account_id: str, name: str) -> Job:
    """The open deployment of ``account_id`` that a request's ``model`` names: its name (the newest of
    that name), its id or a unique prefix of it. Anyone else's is as unknown as a missing one."""
    scope = (Job.account_id == account_id, Job.kind == KIND, Job.state.in_(OPEN_JOB_STATES))
    newest = select(Job).where(*scope, Job.name == name).order_by(Job.created_at.desc(), Job.id)
    if (named := session.scalars(newest).first()) is not None:
        return named
    return ids.lookup(session, Job, name, *scope, what="deployment")


def live_replicas(session: Session, deployment_id: str) -> set[str]:
    """The leases of the deployment's replicas that are live now: only they are handed requests (a
    replica scaled away or lost may still be polling until its agent stops it)."""
    query = select(Lease.id).where(
        Lease.job_id == deployment_id, Lease.state == "active", Lease.phase == SERVING
    )
    return set(session.scalars(query))


def serving(session: Session, account_id: str) -> list[Job]:
    """The open deployments of ``account_id``, oldest first."""
    scope = (Job.account_id == account_id, Job.kind == KIND, Job.state.in_(OPEN_JOB_STATES))
    return list(session.scalars(select(Job).where(*scope).order_by(Job.created_at, Job.id)))


def _replicas(session: Session, deployment: Job) -> list[Task]:
    """The replicas asked for now, by index."""
    query = select(Task).where(Task.job_id == deployment.id, Task.state.in_(LIVE_TASK_STATES))
    return list(session.scalars(query.order_by(Task.index)))


def scale(session: Session, account: Account, deployment_id: str, replicas: int, now: float) -> Job:
    """Ask for ``replicas`` replicas: new ones are placed by the market; the newest beyond the count are
    cancelled (a running one's lease ends now, metered up to now; one that never ran is dropped)."""
    deployment = owned(session, account, deployment_id)
    session.refresh(deployment, with_for_update=True)  # one scale at a time, and never after it ended
    if deployment.state not in OPEN_JOB_STATES:
        raise Conflict(f"deployment {deployment.id} has ended ({deployment.state})")
    current = _replicas(session, deployment)
    if replicas > len(current):
        newest = session.scalar(select(func.max(Task.index)).where(Task.job_id == deployment.id))
        first = -1 if newest is None else newest
        _add_replicas(session, deployment, range(first + 1, first + 1 + replicas - len(current)))
    cancelled = current[replicas:]
    for task in cancelled:
        if task.epoch == 0:  # never leased: nothing ran, nothing to keep
            session.execute(delete(Task).where(Task.id == task.id))
        else:
            leases.cancel_task(session, task, now)
    if replicas != len(current):
        message = f"scaled from {len(current)} to {replicas} replicas by {account.name}"
        session.add(JobEvent(job_id=deployment.id, at=now, message=message))
    return deployment


def stop(session: Session, account: Account, deployment_id: str, now: float, *, fee_bps: int) -> Job:
    """End the deployment: its replicas' leases end, providers' pay is set aside, the rest is refunded,
    and its priced keys' holders pay what their tokens owe."""
    deployment = owned(session, account, deployment_id)
    if deployment.state not in OPEN_JOB_STATES:
        raise Conflict(f"deployment {deployment.id} has already ended ({deployment.state})")
    jobs.finish(session, deployment, "cancelled", f"stopped by {account.name}", now, fee_bps=fee_bps)
    deployment_keys.settle_deployment(session, deployment, now)
    return deployment


def report_phase(session: Session, lease: Lease, phase: ReplicaPhase, now: float) -> None:
    """What a leased replica does before it answers, for its deployment's view and, once, its log."""
    told = update(Lease).where(Lease.id == lease.id, Lease.phase.not_in((phase, SERVING))).values(phase=phase)
    if session.execute(told).rowcount:
        jobs.log_from_task(session, lease, DOING[phase], now)


def ready(session: Session, lease: Lease, now: float) -> None:
    """A replica's first poll of the relay: its model is loaded and it answers from now on, so it is live
    and its deployment runs. Once, whichever coordinator process it polls first."""
    serving = update(Lease).where(Lease.id == lease.id, Lease.phase != SERVING).values(phase=SERVING)
    if not session.execute(serving).rowcount:
        return
    session.execute(
        update(Job).where(Job.id == lease.job_id, Job.state == "starting").values(state="running")
    )
    jobs.log_from_task(
        session, lease, f"ready: answers requests, {now - lease.granted_at:.1f} s after its lease", now
    )


def info(session: Session, deployment: Job, now: float) -> m.DeploymentInfo:
    spec = specs.deployment(deployment)
    leased = session.execute(
        select(Task.index, Lease.phase)
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.job_id == deployment.id, Lease.state == "active")
        .order_by(Task.index)
    ).all()
    doing = "; ".join(f"replica {index} {DOING[phase]}" for index, phase in leased if phase != SERVING)
    asked = session.scalar(
        select(func.count(Task.id)).where(Task.job_id == deployment.id, Task.state.in_(LIVE_TASK_STATES))
    )
    return m.DeploymentInfo(
        id=deployment.id,
        name=deployment.name,
        state=deployment.state,
        created_at=deployment.created_at,
        model=_describe(spec.model),
        replicas=asked or 0,
        live_replicas=sum(phase == SERVING for _, phase in leased),
        budget=to_credits(deployment.budget_micro),
        spent=to_credits(jobs.spent(session, deployment, now)),
        reason=deployment.reason or doing,  # why it ended; while open, what its replicas do
    )


def _describe(model: DeployedModel) -> str:
    if model.job is not None:
        return f"job {model.job} (checkpoint {(model.checkpoint or '')[:12]})"
    return f"{PurePath(model.from_ or '').name or model.from_} (uploaded)"


def detail(session: Session, deployment: Job, now: float) -> m.DeploymentDetail:
    tasks = session.scalars(select(Task).where(Task.job_id == deployment.id).order_by(Task.index))
    return m.DeploymentDetail(
        **info(session, deployment, now).model_dump(),
        spec=specs.deployment(deployment),
        tasks=[jobs.task_info(t) for t in tasks],
        costs=jobs.costs(session, deployment, now),
        keys=deployment_keys.of(session, deployment),
        audits=_audit_counts(session, deployment),
        verdicts=verification.for_job(session, deployment),
    )


def _audit_counts(session: Session, deployment: Job) -> m.InferenceAuditCounts:
    """Its served requests drawn for audit (``inference_audits``), by state."""
    query = select(InferenceAudit.state, func.count(InferenceAudit.id)).where(
        InferenceAudit.job_id == deployment.id
    )
    return m.InferenceAuditCounts(**dict(session.execute(query.group_by(InferenceAudit.state)).all()))
