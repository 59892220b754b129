"""Governance: nodes propose parameter changes and vote with their stake (signed); anyone reads, with
no credentials."""

import logging

from fastapi import APIRouter

from gpuflex.coordinator.auth import Ctx, Public, SignedNode
from gpuflex.coordinator.routes import PUBLIC_READ, errors
from gpuflex.coordinator.services import governance
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/governance", tags=["governance"], responses=errors(404, 409))
log = logging.getLogger("gpuflex.coordinator")


@router.post("/proposals", status_code=201)
def propose(body: m.ProposalCreate, node: SignedNode, ctx: Ctx) -> m.ProposalInfo:
    """Propose a new value for a parameter; needs ``governance_proposal_stake`` credits of stake."""
    with ctx.tx() as s:
        info = governance.info(governance.propose(s, node, body, ctx.settings, ctx.now()))
    log.info("governance proposal", extra={"node_id": node.id, "proposal_id": info.id})
    return info


@router.post("/proposals/{proposal_id}/votes", status_code=201)
def vote(proposal_id: str, body: m.VoteCast, node: SignedNode, ctx: Ctx) -> m.VoteInfo:
    """Vote with this node's stake now. Votes are final: a second vote is a 409."""
    with ctx.tx() as s:
        return governance.vote_info(governance.vote(s, node, proposal_id, body, ctx.now()))


@router.get("/proposals", dependencies=[Public], responses=PUBLIC_READ)
def proposals(ctx: Ctx) -> list[m.ProposalInfo]:
    """Every proposal, newest first. Public."""
    with ctx.tx() as s:
        return [governance.info(p) for p in governance.proposals(s)]


@router.get("/proposals/{proposal_id}", dependencies=[Public], responses=PUBLIC_READ)
def proposal(proposal_id: str, ctx: Ctx) -> m.ProposalDetail:
    """A proposal with its votes and its tally (running while voting is open). Public."""
    with ctx.tx() as s:
        return governance.detail(s, governance.get(s, proposal_id), ctx.settings)


@router.get("/parameters", dependencies=[Public], responses=PUBLIC_READ)
def parameters(ctx: Ctx) -> list[m.ParameterInfo]:
    """The governable parameters: values in force now, and passed changes still to come. Public."""
    with ctx.tx() as s:
        return governance.parameters(s, ctx.settings, ctx.now())
