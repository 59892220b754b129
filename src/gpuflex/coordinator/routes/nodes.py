"""Provider nodes: every call is signed with the node's Ed25519 key."""

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from gpuflex.auth.signing import node_id_for
from gpuflex.coordinator.auth import Ctx, SignedNode, SignedRequest
from gpuflex.coordinator.db import Node
from gpuflex.coordinator.services import leases, registry
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/nodes", tags=["nodes"])


@router.post("/register")
async def register(body: m.NodeRegister, signed: SignedRequest, ctx: Ctx) -> m.NodeRegistered:
    """Join or re-join: signed with the very key being registered. Re-joining ends old leases."""

    def run() -> Node:
        with ctx.tx() as s:
            node_id = node_id_for(body.public_key)
            registry.check_signature(s, body.public_key, node_id, signed, ctx.settings, ctx.now())
            leases.expire_for_node(s, node_id, ctx.now())
            return registry.register(s, body, ctx.settings, ctx.now())

    node = await run_in_threadpool(run)
    return m.NodeRegistered(
        node_id=node.id,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        lease_ttl_s=ctx.settings.lease_ttl_s,
    )


@router.post("/heartbeat")
def heartbeat(body: m.Heartbeat, node: SignedNode, ctx: Ctx) -> m.HeartbeatAck:
    with ctx.tx() as s:
        row = s.get(Node, node.id)
        registry.beat(row, ctx.now())
        revoked = leases.renew(s, row, body.leases, ctx.settings, ctx.now())
    return m.HeartbeatAck(heartbeat_interval_s=ctx.settings.heartbeat_interval_s, revoked=revoked)


@router.post("/lease", responses={204: {"description": "no task for this node now"}})
def lease(node: SignedNode, ctx: Ctx) -> m.LeaseGrant | None:
    with ctx.tx() as s:
        grant = leases.grant(s, s.get(Node, node.id), ctx.settings, ctx.now())
    return grant if grant is not None else Response(status_code=204)


@router.post("/leases/{lease_id}/report")
def report(lease_id: str, body: m.LeaseReport, node: SignedNode, ctx: Ctx) -> dict[str, str]:
    """How a lease ended. A stale epoch is refused with 409 and changes nothing."""
    with ctx.tx() as s:
        leases.report(s, s.get(Node, node.id), lease_id, body, ctx.now())
    return {"status": "recorded"}


@router.post("/leave")
def leave(node: SignedNode, ctx: Ctx) -> dict[str, str]:
    """A draining node says goodbye; the market stops placing work on it."""
    with ctx.tx() as s:
        registry.leave(s.get(Node, node.id))
    return {"status": "left"}
