"""Deployments, seen only by the account that created them; ``{deployment_id}`` may be its name or a
unique prefix of its id (``deployments.owned``)."""

import logging

from fastapi import APIRouter, Request

from gpuflex.coordinator.auth import Consumer, Ctx
from gpuflex.coordinator.routes import errors, unstated
from gpuflex.coordinator.services import deployment_keys, deployments, governance, jobs
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/deployments", tags=["deployments"], responses=errors(404, 409))
log = logging.getLogger("gpuflex.coordinator")


# What a deployment is refused for, and its check before the upload alike.
CREATION_RULES = {
    **errors(402),
    **unstated(
        400,
        "model.job's job has no model to serve (not hf-causal-lm, not tuned, or encrypted), or "
        "model.from's directory is not in the store, whole (the CLI uploads it)",
    ),
    **unstated(422, "a rule across model.training's fields (as a job spec's): the detail names it"),
}


@router.post("", status_code=201, responses=CREATION_RULES)
def create(body: m.DeploymentCreate, account: Consumer, ctx: Ctx) -> m.DeploymentInfo:
    """Deploy a model; the budget moves into escrow at once (402 if the wallet can't cover it)."""
    with ctx.tx() as s:
        deployment = deployments.create(s, account, body, ctx.blobs, ctx.now())
        info = deployments.info(s, deployment, ctx.now())
    log.info("deployment created", extra={"job_id": info.id})
    return info


@router.post("/check", status_code=204, responses=CREATION_RULES)
def check(body: m.DeploymentCreate, account: Consumer, ctx: Ctx) -> None:
    """Refuse now, as ``POST /v1/deployments`` would, a deployment whose model directory is not uploaded
    yet (only sized); nothing is written or spent (204: it would be accepted). ``gpuflex deploy --model``
    asks it before uploading."""
    with ctx.read() as s:
        deployments.check(s, account, body, ctx.blobs)


@router.post("/keys/{key_id}/claim", responses=errors(404, 409))
def claim_key(key_id: str, account: Consumer, ctx: Ctx) -> m.DeploymentKeyCreated:
    """The secret of an API key another account's deployment made for you (you pay its prices); shown
    this once."""
    with ctx.tx() as s:
        claimed = deployment_keys.claim(s, account, key_id, ctx.now())
    log.info("deployment key %s claimed", claimed.id, extra={"job_id": claimed.deployment_id})
    return claimed


@router.get("")
def list_deployments(request: Request, account: Consumer, ctx: Ctx) -> list[m.DeploymentInfo]:
    with ctx.read() as s:
        found = [deployments.info(s, d, ctx.now()) for d in deployments.list_for(s, account)]
    return [request.app.state.relay.measured(info) for info in found]


@router.get("/{deployment_id}")
def show(deployment_id: str, request: Request, account: Consumer, ctx: Ctx) -> m.DeploymentDetail:
    with ctx.read() as s:
        detail = deployments.detail(s, deployments.owned(s, account, deployment_id), ctx.now())
    return request.app.state.relay.measured(detail)


@router.get("/{deployment_id}/logs")
def logs(deployment_id: str, account: Consumer, ctx: Ctx) -> list[m.JobEvent]:
    """Its log: placements (or why a replica waits), leases, scaling, keys, its end."""
    with ctx.read() as s:
        return jobs.events(s, deployments.owned(s, account, deployment_id))


@router.post("/{deployment_id}/scale")
def scale(deployment_id: str, body: m.DeploymentScale, account: Consumer, ctx: Ctx) -> m.DeploymentInfo:
    with ctx.tx() as s:
        deployment = deployments.scale(s, account, deployment_id, body.replicas, ctx.now())
        info = deployments.info(s, deployment, ctx.now())
    log.info("deployment scaled to %d", body.replicas, extra={"job_id": info.id})
    return info


@router.post("/{deployment_id}/stop")
def stop(deployment_id: str, account: Consumer, ctx: Ctx) -> m.DeploymentInfo:
    """End the deployment; what its budget did not pay for goes back to the wallet."""
    with ctx.tx() as s:
        fee_bps = governance.platform_fee_bps(s, ctx.settings, ctx.now())
        deployment = deployments.stop(s, account, deployment_id, ctx.now(), fee_bps=fee_bps)
        info = deployments.info(s, deployment, ctx.now())
    log.info("deployment stopped", extra={"job_id": info.id})
    return info


@router.post("/{deployment_id}/keys", status_code=201, responses=errors(400))
def create_key(
    deployment_id: str, account: Consumer, ctx: Ctx, body: m.DeploymentKeyCreate | None = None
) -> m.DeploymentKeyCreated:
    """An API key that reaches this deployment only (through the OpenAI gateway); shown this once. Made
    for another account (``holder``) at prices per million tokens, that account pays them to you, and
    only it sees the secret (``POST /deployments/keys/{key_id}/claim``)."""
    with ctx.tx() as s:
        deployment = deployments.owned(s, account, deployment_id)
        created = deployment_keys.create(s, deployment, account, body or m.DeploymentKeyCreate(), ctx.now())
    log.info("deployment key %s created", created.id, extra={"job_id": created.deployment_id})
    return created
