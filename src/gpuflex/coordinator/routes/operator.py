"""The operator's verdicts: slashing a node's stake, with evidence; the record is public, to anyone."""

from fastapi import APIRouter

from gpuflex.coordinator.auth import Ctx, Operator, Public
from gpuflex.coordinator.db import Slash
from gpuflex.coordinator.routes import PUBLIC_READ, errors
from gpuflex.coordinator.services import stakes
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits, to_micro

router = APIRouter(tags=["verdicts"])


def _record(row: Slash) -> m.SlashRecord:
    return m.SlashRecord(
        id=row.id,
        node_id=row.node_id,
        job_id=row.job_id,
        amount=to_credits(row.amount_micro),
        withheld=to_credits(row.withheld_micro),
        evidence=row.evidence,
        at=row.at,
    )


@router.post("/slashes", status_code=201, dependencies=[Operator], responses=errors(404, 409))
def slash(body: m.SlashRequest, ctx: Ctx) -> m.SlashRecord:
    """Take stake from a node (and, with ``job_id``, its held pay for that job) for a verdict."""
    with ctx.tx() as s:
        amount = to_micro(body.amount)
        return _record(stakes.slash(s, body.node_id, amount, body.evidence, ctx.now(), job_id=body.job_id))


@router.get("/slashes", dependencies=[Public], responses=PUBLIC_READ)
def slashes(ctx: Ctx) -> list[m.SlashRecord]:
    """Every verdict's penalty, newest first: anyone, with no credentials, sees who was slashed and why."""
    with ctx.tx() as s:
        return [_record(row) for row in stakes.slashes(s)]
