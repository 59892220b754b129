"""Provider nodes: every call is signed with the node's Ed25519 key."""

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from gpuflex.auth.signing import HEADER_NODE, node_id_for
from gpuflex.coordinator.auth import Ctx, SignedNode, SignedRequest, VerifiedSignature, charge
from gpuflex.coordinator.db import Node
from gpuflex.coordinator.groupcommit import Grants, Heartbeats
from gpuflex.coordinator.routes import errors, unstated
from gpuflex.coordinator.services import inference_audits, keys, leases, registry, stakes
from gpuflex.coordinator.web import tokens
from gpuflex.errors import Unauthorized
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_micro

router = APIRouter(prefix="/nodes", tags=["nodes"], responses=errors(404, 409))
log = logging.getLogger("gpuflex.coordinator")


@router.post("/register", responses=unstated(422, "private_data names a dataset twice"))
async def register(
    body: m.NodeRegister, request: Request, signed: SignedRequest, ctx: Ctx
) -> m.NodeRegistered:
    """Join or re-join: signed with the very key being registered. Re-joining ends old leases."""

    def run() -> tuple[Node, float]:
        with ctx.tx() as s:
            node_id = node_id_for(body.public_key)
            registry.check_signature(s, body.public_key, node_id, signed, ctx.settings, ctx.now())
            leases.expire_for_node(s, node_id, ctx.now(), "restarted (registered again)")
            interval_s = ctx.liveness(s).interval_s
            return registry.register(s, body, ctx.settings, ctx.now(), interval_s), interval_s

    node, interval_s = await run_in_threadpool(run)
    ctx.node_keys[node.id] = body.public_key  # its calls take the fast path from the first
    charge(request, f"node:{node.id}")
    log.info("node registered", extra={"node_id": node.id, "kind": node.kind})
    return m.NodeRegistered(
        node_id=node.id, heartbeat_interval_s=interval_s, lease_ttl_s=ctx.settings.lease_ttl_s
    )


@router.post("/heartbeat")
async def heartbeat(
    request: Request, body: m.Heartbeat, signed: VerifiedSignature, writer: Heartbeats
) -> m.HeartbeatAck:
    """Renew leases, learn revocations and the interval; committed together with the heartbeats
    around it (``coordinator.groupcommit``), answered once committed. Good heartbeats are answered
    before they reach here (``coordinator.fastpath``): this route is what the rest meet."""
    node_id, nonce = signed
    charge(request, f"node:{node_id}")
    return await asyncio.wrap_future(writer.submit(registry.Beat(node_id, nonce, tuple(body.leases))))


@router.post("/lease", responses={204: {"description": "no task for this node now"}})
async def lease(request: Request, signed: VerifiedSignature, granter: Grants) -> m.LeaseGrant | None:
    """The next task placed on this node, if any; granted together with the requests around it
    (``coordinator.groupcommit``), answered once committed. Like heartbeats, good lease requests are
    answered by ``coordinator.fastpath``."""
    node_id, nonce = signed
    charge(request, f"node:{node_id}")
    grant = await asyncio.wrap_future(granter.submit(registry.Call(node_id, nonce)))
    return Response(status_code=204) if grant is None else grant


@router.post("/leases/{lease_id}/report")
def report(lease_id: str, body: m.LeaseReport, node: SignedNode, ctx: Ctx) -> dict[str, str]:
    """How a lease ended. A stale epoch is refused with 409 and changes nothing."""
    with ctx.tx() as s:
        leases.report(s, s.get(Node, node.id), lease_id, body, ctx.now())
    log.info("lease reported", extra={"node_id": node.id, "lease_id": lease_id, "outcome": body.outcome})
    return {"status": "recorded"}


@router.post("/leases/{lease_id}/key")
def lease_key(lease_id: str, body: m.LeaseKeyAsk, node: SignedNode, ctx: Ctx) -> m.LeaseKey:
    """An encrypted job's data key sealed to this node, for a live lease at its current epoch only
    (409 otherwise); until the consumer sealed it, why not."""
    with ctx.tx() as s:
        return keys.for_lease(s, node.id, lease_id, body.epoch, ctx.now())


@router.post("/leave")
def leave(node: SignedNode, ctx: Ctx) -> dict[str, str]:
    """A draining node says goodbye; the market stops placing work on it."""
    with ctx.tx() as s:
        registry.leave(s.get(Node, node.id), ctx.now())
    return {"status": "left"}


@router.post("/inference-audits/claim")
def claim_inference_audits(body: m.InferenceAuditClaim, node: SignedNode, ctx: Ctx) -> m.InferenceAuditList:
    """Served requests drawn for audit that this node may re-check: any for a core node; for a community
    node, while no core node is online, those of a deployment it holds a replica of, served elsewhere."""
    with ctx.tx() as s:
        return inference_audits.claim(s, s.get(Node, node.id), body.limit, ctx.now())


@router.post("/inference-audits/{audit_id}/finding")
def inference_finding(
    audit_id: Annotated[int, Path(ge=1, le=m.INT32_MAX)], body: m.InferenceFinding, node: SignedNode, ctx: Ctx
) -> dict[str, str]:
    """The auditor's finding on an audit it claimed: a failed one convicts the provider."""
    with ctx.tx() as s:
        inference_audits.judge(s, s.get(Node, node.id), audit_id, body, ctx.now())
    log.info("inference audit judged", extra={"node_id": node.id, "audit": audit_id, "ok": body.ok})
    return {"status": "recorded"}


@router.get("/wallet")
def wallet(node: SignedNode, ctx: Ctx) -> m.NodeWallet:
    """The node's earnings, pay held in audit windows, stake and what verdicts took."""
    with ctx.tx() as s:
        return stakes.wallet(s, node)


@router.post("/stake", responses=errors(402))
def stake(body: m.StakeChange, node: SignedNode, ctx: Ctx) -> m.NodeWallet:
    """Bond credits, from outside or from earnings: community nodes need ``min_stake`` to get work."""
    with ctx.tx() as s:
        stakes.stake(s, node, to_micro(body.amount), body.source, ctx.now())
        return stakes.wallet(s, node)


@router.post("/unstake", responses=errors(402))
def unstake(body: m.Withdrawal, node: SignedNode, ctx: Ctx) -> m.NodeWallet:
    """Stake back to earnings; refused (409) while the node's work can still be audited."""
    with ctx.tx() as s:
        stakes.unstake(s, node, to_micro(body.amount), ctx.now(), audit_window_s=ctx.settings.audit_window_s)
        return stakes.wallet(s, node)


@router.post("/withdraw", responses=errors(402))
def withdraw(body: m.Withdrawal, node: SignedNode, ctx: Ctx) -> m.NodeWallet:
    """Pay earnings out of the network; 402 if they do not cover it."""
    with ctx.tx() as s:
        stakes.withdraw(s, node, to_micro(body.amount), ctx.now())
        return stakes.wallet(s, node)


@router.post("/dashboard-token")
async def dashboard_token(request: Request, signed: SignedRequest, ctx: Ctx) -> dict[str, str | float]:
    """A short-lived link that signs this node in to its own earnings page on the dashboard.

    A node that has left may still ask: its earnings outlive its time on the market.
    """

    def run() -> str:
        with ctx.tx() as s:
            node = s.get(Node, signed[3].get(HEADER_NODE, ""))
            if node is None:
                raise Unauthorized("unknown node: register first")
            registry.check_signature(s, node.public_key, node.id, signed, ctx.settings, ctx.now())
            return node.id

    node_id = await run_in_threadpool(run)
    charge(request, f"node:{node_id}")
    expires_at = ctx.now() + ctx.settings.dashboard_link_ttl_s
    token = tokens.issue(ctx.settings.resolved_dashboard_secret(), node_id, "link", expires_at)
    return {"token": token, "expires_at": expires_at, "path": f"/dashboard/provider/signin?token={token}"}
