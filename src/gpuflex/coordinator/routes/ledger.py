"""The journal, exported whole with its signatures and the coordinator's public key, so anyone can
re-verify the chain offline."""

from fastapi import APIRouter, Query

from gpuflex.coordinator.auth import Consumer, Ctx
from gpuflex.coordinator.services import ledger
from gpuflex.ledger.export import to_export
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/ledger", tags=["ledger"])


@router.get("/export")
def export(_account: Consumer, ctx: Ctx, after: int = Query(0, ge=0, le=m.INT32_MAX)) -> m.LedgerExport:
    with ctx.tx() as s:
        entries = ledger.entries(s, after_seq=after)
        public_key = ledger.public_key(s)
    return to_export(entries, public_key=public_key)
