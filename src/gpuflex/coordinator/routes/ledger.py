"""The journal, exported whole with its signatures and the coordinator's public key, so anyone can
re-verify the chain offline: public, no credentials needed."""

from fastapi import APIRouter, Query

from gpuflex.coordinator.auth import Ctx, Public
from gpuflex.coordinator.routes import PUBLIC_READ
from gpuflex.coordinator.services import ledger
from gpuflex.ledger.export import to_export
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/ledger", tags=["ledger"])


@router.get("/export", dependencies=[Public], responses=PUBLIC_READ)
def export(ctx: Ctx, after: int = Query(0, ge=0, le=m.INT32_MAX)) -> m.LedgerExport:
    """Every journal entry after ``after``, with its signature and the key that signed it. Public."""
    with ctx.tx() as s:
        entries = ledger.entries(s, after_seq=after)
        public_key = ledger.public_key(s)
    return to_export(entries, public_key=public_key)
