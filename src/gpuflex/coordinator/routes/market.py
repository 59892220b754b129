"""What the market offers: the online nodes with their price and measured speed; quotes of a job on them."""

from fastapi import APIRouter

from gpuflex.coordinator.auth import Consumer, Ctx
from gpuflex.coordinator.services import market, registry
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

router = APIRouter(tags=["market"])


@router.get("/offers")
def offers(_account: Consumer, ctx: Ctx) -> list[m.Offer]:
    with ctx.tx() as s:
        nodes = registry.all_nodes(s)
    out = []
    for node in nodes:
        offer = market.offer_of(node)
        out.append(
            m.Offer(
                node_id=node.id,
                name=node.name,
                kind=node.kind,
                device=node.hardware.get("device", "cpu"),
                gpu=offer.gpus[0] if offer.gpus else None,
                vram_gb=node.vram_gb,
                tflops=node.tflops,
                price_per_hour=offer.price_per_hour,
                region=node.region,
                state=node.state,
            )
        )
    return sorted(out, key=lambda o: (o.state != "online", o.price_per_hour, o.node_id))


@router.post("/quote")
def quote(spec: JobSpec, _account: Consumer, ctx: Ctx) -> m.Quote:
    """What a job would cost and take if submitted now, and on which nodes; nothing is spent."""
    with ctx.tx() as s:
        return market.quote(s, spec)
