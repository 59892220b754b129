"""What the market offers: every node with its price, measured speed, reliability and hours left,
picked and sorted by the offer query language (``gpuflex.market.query``), public like the rest of the
network's record; quotes of a job on them, for a consumer."""

from typing import Annotated

from fastapi import APIRouter
from fastapi import Query as Param

from gpuflex.coordinator.auth import Consumer, Ctx, Public
from gpuflex.coordinator.routes import PUBLIC_READ, SPEC_RULES, unstated
from gpuflex.coordinator.services import ledger, market
from gpuflex.ledger.accounts import consumer
from gpuflex.market import query
from gpuflex.protocol import messages as m
from gpuflex.protocol.money import to_credits
from gpuflex.protocol.spec import JobSpec

router = APIRouter(tags=["market"])

QueryText = Annotated[
    str, Param(max_length=2000, description='e.g. "vram>=16 price<=0.5 region in [eu, us]"; empty: all')
]
# The order's grammar is stated, not enforced here: ``parse_order`` refuses a bad key by name.
OrderText = Annotated[
    str,
    Param(
        max_length=200,
        description="e.g. price,-reliability; default: online first, cheapest",
        json_schema_extra={"pattern": query.ORDER_PATTERN},
    ),
]


@router.get(
    "/offers",
    dependencies=[Public],
    responses={
        **unstated(400, "a query the query language does not parse (the detail points at the token)"),
        **PUBLIC_READ,
    },
)
def offers(ctx: Ctx, q: QueryText = "", order: OrderText = "") -> list[m.Offer]:
    """The nodes on offer that the query matches, in the order asked. Public."""
    wanted, keys = query.parse(q), query.parse_order(order)
    with ctx.tx() as s:
        listed = market.listing(s, ctx.now(), ctx.liveness(s).interval_s)
    return query.select(listed, wanted, keys)


@router.post(
    "/quote",
    responses={**SPEC_RULES, **unstated(400, "a federated job is not quoted: it runs on its data's owners")},
)
def quote(spec: JobSpec, account: Consumer, ctx: Ctx) -> m.Quote:
    """What a job would cost and take if submitted now, and on which nodes; nothing is spent. It carries
    the caller's wallet, so a budget the wallet does not cover is said before ``submit`` refuses it."""
    with ctx.tx() as s:
        interval_s = ctx.liveness(s).interval_s
        quoted = market.quote(s, spec, ctx.settings, ctx.now(), interval_s)
        quoted.wallet = to_credits(ledger.balance(s, consumer(account.id)))
        return quoted
