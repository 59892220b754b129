"""Jobs: submission with escrow, the state machine, views for their owner, and settlement.

``pending -> scheduled -> running -> completed | failed | cancelled | out_of_budget`` (its budget spent,
whatever it had done). A job ends exactly once: the state change, the closing of its leases and the
settlement entry (payouts, platform fee, refund) are one transaction, so a crash can't pay twice or leave
money in escrow.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Account, Job, JobEvent, Lease, Node, Round, Task, new_id
from gpuflex.coordinator.services import (
    dp,
    federated,
    ids,
    keys,
    leases,
    ledger,
    secure,
    specs,
    timings,
    verification,
)
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.data.fit import check_job
from gpuflex.data.manifest import parse_manifest
from gpuflex.errors import BadRequest, Conflict, InsufficientFunds
from gpuflex.ledger import accounts
from gpuflex.ledger.settlement import scale_to, settle_job
from gpuflex.market.federated import Owners
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import format_credits, to_credits, to_micro
from gpuflex.protocol.spec import JobSpec, ModelSize, UploadedModel
from gpuflex.storage import BlobStore
from gpuflex.storage.bundles import Bundle, model_problem

MAX_TASK_FAILURES = 3


@dataclass(frozen=True)
class Admitted:
    """A submission that passed every rule before money moves: its spec (a federated job's with its
    owners' count), the owners, the DP log line and the sealed data key."""

    spec: JobSpec
    owners: Owners | None
    privacy: str | None
    sealed_key: str | None


def admit(
    session: Session, account: Account, msg: m.JobSubmit, blobs: BlobStore, *, stored: bool
) -> Admitted:
    """Every rule a submission must pass before money moves. Not yet ``stored`` (``check``: asked before
    anything large is uploaded), the blobs it names need not be in the store: what they are is checked
    without them (a prepared dataset's manifest by ``check_dataset``, a model directory by its size)."""
    if stored:
        for what, digest in (("dataset", msg.dataset), ("recipe code", msg.recipe_code)):
            if digest is not None and not blobs.exists(digest):
                raise BadRequest(f"{what} blob {digest} is not in the blob store: upload it first")
    if (msg.spec.training.recipe == "user") != (msg.recipe_code is not None):
        raise BadRequest("recipe 'user' needs its recipe code uploaded, and only it takes recipe code")
    if msg.spec.training.model.from_ is not None:
        model = msg.spec.training.model
        sealed = msg.spec.privacy.encrypt
        check_uploaded_model(
            model.uploaded, model.size, blobs, "training.model.from", readable=not sealed, stored=stored
        )
    spec, owners = msg.spec, None
    privacy = dp.submitted(spec)  # a DP setting the accountant refuses is refused before money moves
    sealed_key = keys.submitted(msg)
    if spec.data.federated is not None:
        if msg.dataset is not None:
            raise BadRequest("data.federated: the data stays with its owners; upload no dataset")
        owners = federated.owners(session, spec, account)
        spec = federated.with_owners(spec, owners)
        secure.threshold(spec)  # too few owners for secure aggregation: refused before money moves
    return Admitted(spec, owners, privacy, sealed_key)


def submit(session: Session, account: Account, msg: m.JobSubmit, blobs: BlobStore, now: float) -> Job:
    admitted = admit(session, account, msg, blobs, stored=True)
    spec, owners, privacy = admitted.spec, admitted.owners, admitted.privacy
    job = Job(
        id=new_id("j"),
        account_id=account.id,
        name=spec.name,
        spec=spec.model_dump(mode="json"),
        dataset=msg.dataset,
        recipe_code=msg.recipe_code,
        sealed_key=admitted.sealed_key,
        state="pending",
        reason="",
        created_at=now,
        budget_micro=to_micro(msg.spec.budget),
        round=-1,
    )
    escrow(session, account, job, now)
    session.add(JobEvent(job_id=job.id, at=now, message=f"submitted by {account.name}; budget in escrow"))
    if privacy is not None:
        session.add(JobEvent(job_id=job.id, at=now, message=privacy))
    if owners is not None:
        if (warning := dp.noise_warning(spec, [o.dataset.tokens for o in owners.used])) is not None:
            session.add(JobEvent(job_id=job.id, at=now, message=warning))
        federated.add_tasks(session, job, owners, now)
        return job
    session.add(Task(id=new_id("t"), job_id=job.id, role="aggregator", index=0, state="pending"))
    for i in range(spec.resources.workers):
        session.add(Task(id=new_id("t"), job_id=job.id, role="worker", index=i, state="pending"))
    return job


def check(session: Session, account: Account, msg: m.JobSubmit, blobs: BlobStore) -> None:
    """Refuse now what ``submit`` would refuse of ``msg`` once its blobs are uploaded, writing nothing:
    its rules (``admit``) and a wallet short of its budget. The CLI asks it before the first large upload."""
    admit(session, account, msg, blobs, stored=False)
    covers(session, account, to_micro(msg.spec.budget))


def escrow(session: Session, account: Account, job: Job, now: float) -> None:
    """Add a new job (or deployment) row and move its budget from its owner's wallet into its escrow; a
    wallet that can't cover it is a 402 that says how much to deposit."""
    session.add(job)
    session.flush()
    wallet = accounts.consumer(account.id)
    try:
        ledger.append(
            session,
            kind="escrow",
            memo=f"budget of job {job.id} into escrow",
            postings=[(wallet, -job.budget_micro), (accounts.escrow(job.id), job.budget_micro)],
            now=now,
        )
    except InsufficientFunds:
        raise InsufficientFunds(_short_of(ledger.balance(session, wallet), job.budget_micro)) from None


def covers(session: Session, account: Account, budget_micro: int) -> None:
    """402, in ``escrow``'s words, unless ``account``'s wallet holds ``budget_micro``; nothing moves."""
    balance = ledger.balance(session, accounts.consumer(account.id))
    if balance < budget_micro:
        raise InsufficientFunds(_short_of(balance, budget_micro))


def check_dataset(msg: m.JobSubmit, blobs: BlobStore, *, stored: bool = True) -> None:
    """A job on a prepared dataset: its manifest blob parses, fits the job (``data.fit``: the tokenizer
    the model, the tokens the workers and block size), and, once ``stored``, every shard it names is in
    the store (a check before the upload has the manifest alone, which is small). An encrypted one's
    manifest is ciphertext here: the consumer's CLI checked it before encrypting it."""
    if msg.spec.data.prepared is None or msg.sealed_key is not None:
        return
    if msg.dataset is None:
        raise BadRequest("data.prepared: upload the dataset's manifest and name it as the job's dataset")
    if not blobs.exists(msg.dataset):
        raise BadRequest(f"dataset blob {msg.dataset} is not in the blob store: upload it first")
    manifest = parse_manifest(blobs.get(msg.dataset), f"dataset blob {msg.dataset} (a prepared manifest)")
    check_job(manifest, msg.spec)
    if not stored:
        return
    shards = manifest.train + manifest.validation
    absent = [s for s in shards if not blobs.exists(s.sha256)]
    if absent:
        named = ", ".join(f"{s.file} ({s.sha256})" for s in absent[:3])
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise BadRequest(
            f"the blob store lacks {len(absent)} of the dataset's {len(shards)} shards: {named}{more}; "
            "upload them first"
        )


def check_uploaded_model(
    uploaded: UploadedModel | None,
    size: ModelSize | None,
    blobs: BlobStore,
    field: str,
    readable: bool = True,
    *,
    stored: bool = True,
) -> None:
    """A job's ``training.model.from`` or a deployment's ``model.from`` (``field``) names an uploaded model
    directory whose every blob the store holds, with a config.json and safetensors weights (the CLI
    uploads it); whether transformers builds it is checked by the CLI, which has transformers. An
    encrypted job's manifest is ciphertext here (not ``readable``): the consumer's CLI checked the
    directory before encrypting it, and a part missing fails the job's first task, not the submit. Not yet
    ``stored`` (a check before the upload), the directory need only be sized: the CLI checked its files."""
    if not stored:
        if size is None:
            raise BadRequest(f"{field}: the model directory is not sized (the CLI sizes it)")
        return
    if uploaded is None or size is None:
        raise BadRequest(f"{field}: the model directory is not uploaded (the CLI uploads it)")
    if not blobs.exists(uploaded.manifest):
        raise BadRequest(f"model manifest blob {uploaded.manifest} is not in the blob store: upload it first")
    if not readable:
        return
    bundle = Bundle.from_bytes(blobs.get(uploaded.manifest))
    if problem := model_problem([f.name for f in bundle.files]):
        raise BadRequest(f"{field}: the model directory {problem}")
    absent = [d for d in bundle.digests() if not blobs.exists(d)]
    if absent:
        raise BadRequest(
            f"{len(absent)} blobs of the model directory are not in the blob store, {absent[0]} first"
        )


def _short_of(wallet_micro: int, budget_micro: int) -> str:
    """A wallet short of a job's budget, in its owner's words, with the deposit that would cover it."""
    have, budget, missing = (
        format_credits(to_credits(x)) for x in (wallet_micro, budget_micro, budget_micro - wallet_micro)
    )
    return (
        f"your wallet holds {have} credits and this job's budget is {budget}: "
        f"add {missing} with `gpuflex wallet deposit {missing}`, or lower the budget"
    )


def owned(session: Session, account: Account, job_id: str) -> Job:
    """The job, if it is this account's, by its id or a unique prefix of it (``ids``); someone else's job
    is as unknown as a missing one. Every query of a consumer's job passes here."""
    return ids.lookup(session, Job, job_id, *mine(account, "training"), what="job")


def mine(account: Account, kind: str) -> tuple:
    """The rows of ``kind`` (training or deployment) that ``account`` owns."""
    return Job.account_id == account.id, Job.kind == kind


def list_for(session: Session, account: Account, kind: str = "training") -> list[Job]:
    """The account's training jobs, or its deployments, oldest first."""
    return list(session.scalars(select(Job).where(*mine(account, kind)).order_by(Job.created_at)))


def spent(session: Session, job: Job, now: float) -> int:
    """What the job costs its owner: metered lease time, never more than the budget in escrow."""
    return min(job.budget_micro, metered(session, [job.id], now)[job.id])


def metered(session: Session, job_ids: Collection[str], now: float) -> dict[str, int]:
    """Each job's leases' cost so far: the ended ones' as set when they ended, summed by the database, and
    the live ones' up to now. The reaper asks it of every open job each pass: when it loaded every lease
    each job ever had, py-spy sampled it a third as often as the lease writer in a storm of lease requests."""
    costs = dict.fromkeys(job_ids, 0)
    ended = (
        select(Lease.job_id, func.sum(Lease.cost_micro))
        .where(Lease.job_id.in_(list(costs)), Lease.state != "active")
        .group_by(Lease.job_id)
    )
    for job_id, cost in session.execute(ended):
        costs[job_id] += int(cost)  # PostgreSQL sums a bigint as a numeric
    live = select(Lease.job_id, Lease.granted_at, Lease.expires_at, Lease.ended_at, Lease.price_micro).where(
        Lease.job_id.in_(list(costs)), Lease.state == "active"
    )
    for lease in session.execute(live):
        costs[lease.job_id] += leases.metered_cost(lease, now)
    return costs


def finish(session: Session, job: Job, state: str, reason: str, now: float, *, fee_bps: int) -> None:
    """End a job once: close its leases, set the providers' pay aside, take the fee, refund the rest.

    The pay goes to ``held:<job>/<node>`` accounts, released after the audit window (``payouts``).

    The job's row is locked and read afresh first, so two coordinator replicas can't both settle it.
    """
    session.refresh(job, with_for_update=True)
    if job.state not in OPEN_JOB_STATES:
        return
    job.state, job.reason, job.finished_at = state, reason, now
    if state == "completed":
        timings.record(session, job, now)
    leases.end_for_job(session, job, now, task_state="completed" if state == "completed" else "cancelled")
    secure.discard(session, job.id)
    session.flush()
    costs: dict[str, int] = defaultdict(int)
    for lease in session.scalars(select(Lease).where(Lease.job_id == job.id)):
        costs[accounts.held(job.id, lease.node_id)] += lease.cost_micro
    escrow = accounts.escrow(job.id)
    postings = settle_job(
        escrow_balance=ledger.balance(session, escrow),
        costs=costs,
        fee_bps=fee_bps,
        consumer_account=accounts.consumer(job.account_id),
        escrow_account=escrow,
    )
    if postings:
        ledger.append(session, kind="settlement", memo=f"job {job.id} {state}", postings=postings, now=now)
    session.add(JobEvent(job_id=job.id, at=now, message=f"{state}{': ' + reason if reason else ''}; settled"))


def cancel(session: Session, account: Account, job_id: str, now: float, *, fee_bps: int) -> Job:
    job = owned(session, account, job_id)
    if job.state not in OPEN_JOB_STATES:
        raise Conflict(f"job {job.id} has already ended ({job.state})")
    finish(session, job, "cancelled", f"cancelled by {account.name}", now, fee_bps=fee_bps)
    return job


def enforce_limits(session: Session, now: float, *, fee_bps: int) -> None:
    """Stop running jobs that spent their budget, whose task failed too often, or whose task waited too long
    for its data key."""
    jobs = list(session.scalars(select(Job).where(Job.state.in_(OPEN_JOB_STATES))))
    ids = [job.id for job in jobs]
    most_failures = dict(
        session.execute(
            select(Task.job_id, func.max(Task.failures)).where(Task.job_id.in_(ids)).group_by(Task.job_id)
        ).all()
    )
    costs = metered(session, ids, now)
    keyless = keys.overdue(session, jobs, now)
    for job in jobs:
        failures = most_failures.get(job.id) or 0
        if failures >= MAX_TASK_FAILURES:
            finish(session, job, "failed", f"a task failed {failures} times", now, fee_bps=fee_bps)
        elif job.id in keyless:
            finish(session, job, "failed", keyless[job.id], now, fee_bps=fee_bps)
        elif costs[job.id] >= job.budget_micro:
            finish(session, job, "out_of_budget", "budget spent", now, fee_bps=fee_bps)


def info(session: Session, job: Job, now: float) -> m.JobInfo:
    spec = specs.of(job)
    live = session.scalar(
        select(func.count(Lease.id))
        .join(Task, Task.id == Lease.task_id)
        .where(Lease.job_id == job.id, Lease.state == "active", Task.role == "worker")
    )
    return m.JobInfo(
        id=job.id,
        name=job.name,
        state=job.state,
        created_at=job.created_at,
        round=max(job.round, 0),
        rounds=spec.training.rounds,
        budget=to_credits(job.budget_micro),
        spent=to_credits(spent(session, job, now)),
        live_workers=live or 0,
        initial_val_loss=job.initial_val_loss,
        val_loss=job.val_loss,
        train_loss=job.train_loss,
        checkpoint=job.checkpoint,
        reason=job.reason,
    )


def detail(session: Session, job: Job, now: float) -> m.JobDetail:
    tasks = session.scalars(select(Task).where(Task.job_id == job.id).order_by(Task.role, Task.index))
    rounds = session.scalars(select(Round).where(Round.job_id == job.id).order_by(Round.round))
    spec = specs.of(job)
    return m.JobDetail(
        **info(session, job, now).model_dump(),
        spec=spec,
        tasks=[task_info(t) for t in tasks],
        owners=federated.owners_of(session, job, spec),
        privacy=dp.status(spec, job.round),
        key_waits=keys.waits(session, job),
        rounds_log=[
            m.RoundInfo(
                round=r.round,
                update=r.update,
                checkpoint=r.checkpoint,
                tokens=r.tokens,
                val_loss=r.val_loss,
                train_loss=r.train_loss,
                contributions=r.contributions,
                published_at=r.published_at,
                epsilon=r.epsilon,
            )
            for r in rounds
        ],
        costs=costs(session, job, now),
        clearing_price=None if job.clearing_price_micro is None else to_credits(job.clearing_price_micro),
        verdicts=verification.for_job(session, job),
    )


def task_info(task: Task) -> m.TaskInfo:
    return m.TaskInfo(
        id=task.id,
        role=task.role,
        index=task.index,
        state=task.state,
        node_id=task.node_id,
        epoch=task.epoch,
        placement=task.placement,
    )


def costs(session: Session, job: Job, now: float) -> list[m.NodeCost]:
    """Each node's lease time, metered cost, and what the owner pays for it: the metered costs cut to the
    budget as settlement cuts them (``scale_to``), so they add up to ``spent`` and, once the job has
    ended, to what the ledger settled."""
    seconds: dict[str, float] = defaultdict(float)
    metered: dict[str, int] = defaultdict(int)
    for lease in session.scalars(select(Lease).where(Lease.job_id == job.id)):
        end = lease.ended_at if lease.ended_at is not None else min(now, lease.expires_at)
        seconds[lease.node_id] += max(0.0, end - lease.granted_at)
        metered[lease.node_id] += leases.metered_cost(lease, now)
    paid = scale_to(metered, job.budget_micro)
    out = []
    for node_id in sorted(metered):
        node = session.get(Node, node_id)
        out.append(
            m.NodeCost(
                node_id=node_id,
                name=node.name,
                kind=node.kind,
                seconds=round(seconds[node_id], 3),
                cost=to_credits(paid[node_id]),
                metered=to_credits(metered[node_id]),
            )
        )
    return out


def events(session: Session, job: Job) -> list[m.JobEvent]:
    rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id))
    return [m.JobEvent(at=e.at, message=e.message) for e in rows]


def log_from_task(session: Session, lease: Lease, message: str, now: float) -> None:
    """A task's own line in its job's log, saying who wrote it: ``[worker 1 on c0 (n-…)] message``."""
    task, node = session.get(Task, lease.task_id), session.get(Node, lease.node_id)
    who = f"{task.role} {task.index} on {node.name} ({node.id})"
    session.add(JobEvent(job_id=lease.job_id, at=now, message=f"[{who}] {message}"))
