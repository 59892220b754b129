"""The round protocol as a task subprocess sees it, authenticated by its lease's task token."""

import logging
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from gpuflex.coordinator.auth import Ctx, TaskLease
from gpuflex.coordinator.metrics import Metrics
from gpuflex.coordinator.routes import errors, unstated
from gpuflex.coordinator.services import governance, jobs, rounds, secure, verification
from gpuflex.protocol import messages as m

# A task token stops working when its lease ends (409); ids it names may not exist (404).
router = APIRouter(prefix="/task", tags=["tasks"], responses=errors(404, 409))
logger = logging.getLogger("gpuflex.coordinator")  # `log` is the route below

NOT_STORED = "a blob the body names is not in the store: upload it first"


@router.get("/round", responses={204: {"description": "round 0 is not published yet"}})
def latest_round(lease: TaskLease, ctx: Ctx) -> m.RoundState | None:
    with ctx.tx() as s:
        state = rounds.latest(s, lease, ctx.now())
    return state if state is not None else Response(status_code=204)


@router.get("/rounds/{round_}")
def round_state(
    round_: Annotated[int, Path(ge=0, le=m.INT32_MAX)], lease: TaskLease, ctx: Ctx
) -> m.RoundState:
    """A published round, for a replica catching up update by update."""
    with ctx.tx() as s:
        return rounds.get(s, lease, round_, ctx.now())


@router.post("/contributions", responses=unstated(400, NOT_STORED))
def contribute(body: m.ContributionSubmit, lease: TaskLease, ctx: Ctx) -> m.ContributionReceipt:
    """``accepted`` is false when the round has closed: the worker should catch up. ``audit_segment``
    set: the contribution was drawn for audit, post that segment's starting state (``/audit-states``)."""
    with ctx.tx() as s:
        return rounds.contribute(s, lease, body, ctx.blobs, ctx.now())


@router.post("/secagg")
def post_secagg(body: m.SecAggPost, lease: TaskLease, ctx: Ctx) -> dict[str, str]:
    """A message of a secure-aggregation round (``train.secure``), relayed to the job's other tasks."""
    with ctx.tx() as s:
        secure.post(s, lease, body, ctx.now())
    return {"status": "stored"}


@router.get("/secagg")
def secagg_messages(
    lease: TaskLease,
    ctx: Ctx,
    round: int = Query(ge=0, le=m.INT32_MAX),
    after: int = Query(-1, ge=-1, le=m.INT32_MAX),  # a seq: a row id, a 32-bit column
) -> m.SecAggList:
    """The round's messages after ``after`` (a ``seq``) this task may read: the aggregator all, a worker
    those to all and to it."""
    with ctx.read() as s:
        return secure.messages(s, lease, round, after)


@router.post("/audit-states", responses=unstated(400, NOT_STORED))
def audit_state(body: m.AuditStateSubmit, lease: TaskLease, ctx: Ctx) -> dict[str, str]:
    """A worker's state at the start of the segment drawn from its own contribution."""
    with ctx.tx() as s:
        verification.submit_audit_state(s, lease, body, ctx.blobs)
    return {"status": "stored"}


@router.post(
    "/peer-audits", responses=unstated(400, f"{NOT_STORED}; or the auditor is not another worker of the job")
)
def assign_peer_audit(body: m.PeerAuditAssign, lease: TaskLease, ctx: Ctx) -> dict[str, str]:
    """The aggregator hands a drawn contribution's segments to another worker of its job to re-run."""
    with ctx.tx() as s:
        verification.assign_peer_audit(s, lease, body, ctx.blobs, ctx.now())
    ids = {"job_id": lease.job_id, "node_id": lease.node_id, "round": body.round}
    logger.info("peer audit of %s assigned to %s", body.task_id, body.auditor, extra=ids)
    return {"status": "assigned"}


@router.get("/peer-audits")
def peer_audits(
    lease: TaskLease, ctx: Ctx, round: int | None = Query(None, ge=0, le=m.INT32_MAX)
) -> m.PeerAuditList:
    """The aggregator: every assignment of its job, with the hashes reported. A worker: the assignments
    its task still has to re-run (a read: workers poll it between rounds)."""
    with ctx.read() as s:
        return verification.peer_audits(s, lease, round)


@router.post("/peer-audits/report")
def report_peer_audit(body: m.PeerAuditReport, lease: TaskLease, ctx: Ctx) -> dict[str, str]:
    """An auditor's trace hashes for the segments it re-ran; its first report stands."""
    with ctx.tx() as s:
        verification.report_peer_audit(s, lease, body, ctx.now())
    ids = {"job_id": lease.job_id, "node_id": lease.node_id, "round": body.round}
    logger.info("peer audit of %s reported: %d hashes", body.task_id, len(body.hashes), extra=ids)
    return {"status": "reported"}


@router.post(
    "/verdicts",
    responses=unstated(400, "inference-audit verdicts come from a deployment's auditors, not an aggregator"),
)
def verdict(body: m.VerdictSubmit, lease: TaskLease, ctx: Ctx, metrics: Metrics) -> m.Verdict:
    """The aggregator's verdict on a contribution of its job; a guilty one slashes and bars the node."""
    with ctx.tx() as s:
        recorded = verification.record(s, lease, body, ctx.now())
    metrics.verdicts.labels(check=recorded.check, guilty=str(recorded.guilty).lower()).inc()
    ids = {"job_id": lease.job_id, "node_id": recorded.node_id, "round": recorded.round}
    outcome = "guilty" if recorded.guilty else "clean"
    logger.info("verdict %s (%s): %s", outcome, recorded.check, recorded.reason, extra=ids)
    return recorded


@router.get("/contributions")
def contributions(lease: TaskLease, ctx: Ctx, round: int = Query(ge=0, le=m.INT32_MAX)) -> m.ContributionList:
    with ctx.tx() as s:
        suspect_after_s = ctx.liveness(s).suspect_after_s
        return rounds.contributions(s, lease, round, heard_since=ctx.now() - suspect_after_s)


@router.post(
    "/rounds",
    responses=unstated(400, f"{NOT_STORED}; or the round lacks the state or update it must carry"),
)
def publish(body: m.RoundPublish, lease: TaskLease, ctx: Ctx, metrics: Metrics) -> dict[str, str]:
    with ctx.tx() as s:
        fee_bps = governance.platform_fee_bps(s, ctx.settings, ctx.now())
        rounds.publish(s, lease, body, ctx.blobs, ctx.now(), fee_bps=fee_bps)
    metrics.rounds_published.inc()
    ids = {"job_id": lease.job_id, "node_id": lease.node_id, "round": body.round}
    logger.info("round published", extra=ids)
    return {"status": "published"}


@router.post("/log")
def log(body: m.TaskLog, lease: TaskLease, ctx: Ctx) -> dict[str, str]:
    with ctx.tx() as s:
        jobs.log_from_task(s, lease, body.message, ctx.now())
    return {"status": "logged"}
