"""Jobs, seen only by the account that submitted them; ``{job_id}`` may be a unique prefix of the id."""

import logging

from fastapi import APIRouter, Response

from gpuflex.coordinator import presigned
from gpuflex.coordinator.auth import Consumer, Ctx
from gpuflex.coordinator.downloads import streamed_blob
from gpuflex.coordinator.metrics import Metrics
from gpuflex.coordinator.routes import SPEC_RULES, errors, unstated
from gpuflex.coordinator.services import governance, jobs, keys, verification
from gpuflex.errors import Conflict
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=errors(404, 409))
log = logging.getLogger("gpuflex.coordinator")

NOT_ENCRYPTED = unstated(400, "the job is not encrypted (privacy.encrypt): it has no keys")


# What a submission is refused for, and its check before the upload alike.
SUBMISSION_RULES = {
    **errors(402),
    **SPEC_RULES,
    **unstated(
        400,
        "a blob the job names (dataset, recipe code, model directory) is not in the store or does not "
        "fit the spec (a dataset of a federated job, a sealed key without privacy.encrypt, ...)",
    ),
}


@router.post("", status_code=201, responses=SUBMISSION_RULES)
def submit(body: m.JobSubmit, account: Consumer, ctx: Ctx) -> m.JobInfo:
    """Submit a job; its budget moves into escrow at once (402 if the wallet can't cover it)."""
    jobs.check_dataset(body, ctx.blobs)  # reads blobs: before the transaction, not while holding it
    with ctx.tx() as s:
        job = jobs.submit(s, account, body, ctx.blobs, ctx.now())
        info = jobs.info(s, job, ctx.now())
    log.info("job submitted", extra={"job_id": info.id})
    return info


@router.post("/check", status_code=204, responses=SUBMISSION_RULES)
def check(body: m.JobSubmit, account: Consumer, ctx: Ctx) -> None:
    """Refuse now, as ``POST /v1/jobs`` would, a submission whose blobs are not uploaded yet; nothing is
    written or spent (204: it would be accepted once they are). ``gpuflex submit`` asks it before uploading
    a model or data: a prepared dataset's manifest must be uploaded, the rest need not be."""
    jobs.check_dataset(body, ctx.blobs, stored=False)
    with ctx.read() as s:
        jobs.check(s, account, body, ctx.blobs)


@router.get("")
def list_jobs(account: Consumer, ctx: Ctx) -> list[m.JobInfo]:
    with ctx.tx() as s:
        return [jobs.info(s, job, ctx.now()) for job in jobs.list_for(s, account)]


@router.get("/{job_id}")
def show(job_id: str, account: Consumer, ctx: Ctx) -> m.JobDetail:
    with ctx.tx() as s:
        return jobs.detail(s, jobs.owned(s, account, job_id), ctx.now())


@router.post("/{job_id}/cancel")
def cancel(job_id: str, account: Consumer, ctx: Ctx) -> m.JobInfo:
    with ctx.tx() as s:
        fee_bps = governance.platform_fee_bps(s, ctx.settings, ctx.now())
        job = jobs.cancel(s, account, job_id, ctx.now(), fee_bps=fee_bps)
        info = jobs.info(s, job, ctx.now())
    log.info("job cancelled", extra={"job_id": info.id})
    return info


@router.get("/{job_id}/keys", responses=NOT_ENCRYPTED)
def key_requests(job_id: str, account: Consumer, ctx: Ctx) -> m.JobKeys:
    """An encrypted job's data key sealed to its owner, and the live leases that wait for theirs."""
    with ctx.tx() as s:
        return keys.requests(s, jobs.owned(s, account, job_id))


@router.post("/{job_id}/keys", responses=NOT_ENCRYPTED)
def grant_key(job_id: str, body: m.KeyGrant, account: Consumer, ctx: Ctx) -> dict[str, str]:
    """The data key sealed to one live lease's node (409 once that lease or epoch has ended)."""
    with ctx.tx() as s:
        keys.grant(s, jobs.owned(s, account, job_id), body, ctx.now())
    return {"status": "sealed"}


@router.get("/{job_id}/verdicts")
def verdicts(job_id: str, account: Consumer, ctx: Ctx) -> list[m.Verdict]:
    """What verification found on the job's contributions, newest first."""
    with ctx.tx() as s:
        return verification.for_job(s, jobs.owned(s, account, job_id))


@router.get("/{job_id}/logs")
def logs(job_id: str, account: Consumer, ctx: Ctx) -> list[m.JobEvent]:
    with ctx.tx() as s:
        return jobs.events(s, jobs.owned(s, account, job_id))


@router.get(
    "/{job_id}/checkpoint",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, **presigned.REDIRECT},
)
def checkpoint(job_id: str, account: Consumer, ctx: Ctx, metrics: Metrics) -> Response:
    """The job's model as safetensors bytes: the final one once the job completed, else its newest
    checkpoint (``rounds_log`` says which round has this ``X-Content-SHA256``); from an object store, a
    307 to a presigned URL of those bytes."""
    with ctx.tx() as s:
        job = jobs.owned(s, account, job_id)
    if job.checkpoint is None:
        raise Conflict(f"job {job.id} has no checkpoint yet ({job.state})")
    if redirect := presigned.redirect(ctx, metrics, job.checkpoint, {"X-Content-SHA256": job.checkpoint}):
        return redirect
    return streamed_blob(ctx.blobs, job.checkpoint, metrics, headers={"X-Content-SHA256": job.checkpoint})
