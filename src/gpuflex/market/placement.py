"""Placement: one job's unplaced tasks onto free offers, as one decision (aggregator, then workers).

The coordinator's ``services.market.place_pending`` turns rows into offers and writes this decision
back; the simulator (``gpuflex.sim``) hands it a pre-filtered candidate set. Both call this function,
so the rules below are the ones the network runs:

- the aggregator first, on the cheapest eligible core node (``matching.place_aggregator``);
- then the workers, on the nodes left: by rank at the nodes' own prices (``pricing: fixed``); an
  auction job by its auction the first time (which sets its clearing price), then each replacement
  among the nodes asking at most that price (``pricing.place_replacement``);
- a job that has not started is placed as a gang: its aggregator and at least ``min_workers`` workers
  (``start_size``) together, or nothing (``Short`` says what it could place), so it never runs on fewer
  workers than it asked for. Once started it takes what it can: a lost worker's replacement, or a
  worker beyond ``min_workers`` the market could not place at first, joins when a node frees;
- a community node below the governed ``min_stake`` takes no work (``unstaked``).

Why tasks wait, node by node, is ``market.waiting``'s to tell.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuflex.market import pricing
from gpuflex.market.index import OfferIndex
from gpuflex.market.matching import (
    Choice,
    NodeOffer,
    Requirements,
    WorkerPlacement,
    place_aggregator,
    place_workers,
)
from gpuflex.market.waiting import Held
from gpuflex.protocol.money import to_credits


@dataclass(frozen=True)
class Short:
    """Why a job that has not started placed nothing: its aggregator and ``needed`` workers must be
    placed together (``resources.min_workers``), and this is what it could have had now."""

    needed: int
    # the nodes its workers could have had: fewer than needed, or enough but no aggregator
    workers: tuple[Choice, ...]
    wait_reason: str | None  # why the job's own rules (core quota, auction) held workers back
    aggregator: Choice | None  # the node its aggregator could have had
    no_aggregator: bool  # it needs one and no core node can host it


@dataclass(frozen=True)
class JobPlacement:
    aggregator: Choice | None  # None: no aggregator was asked for, or none qualifies
    workers: WorkerPlacement
    clearing_price: float | None  # an auction that cleared just now sets the job's price; else None
    short: Short | None = None  # set when a job not yet started placed nothing: why

    @property
    def chosen(self) -> set[str]:
        """Every node this placement takes (now busy)."""
        agg = {self.aggregator.node_id} if self.aggregator else set()
        return agg | {c.node_id for c in self.workers.choices}


def place_job(
    req: Requirements,
    pricing_mode: str,
    offers: Sequence[NodeOffer],
    *,
    aggregator: bool,
    workers: int,
    busy: set[str],
    core_already: int = 0,
    clearing_price: float | None = None,
    index: OfferIndex | None = None,
    gang: int = 0,
) -> JobPlacement:
    """Place the job's aggregator (when ``aggregator``) and ``workers`` workers on nodes not in ``busy``.

    ``core_already``: the job's workers already on core nodes (they count toward its core quota);
    ``clearing_price``: the job's auction price if its auction already cleared; ``index``: the same
    offers indexed (``market.index``), which places fixed-price workers without a scan: the coordinator
    builds one per pass, since a scan of 100,000 offers per job is too slow; ``gang``: the fewest
    workers it may place (``start_size``), else nothing at all, aggregator included (``short``).
    """
    agg = place_aggregator(req, offers, exclude=busy) if aggregator else None
    taken = busy | {agg.node_id} if agg else busy
    placed, price = _place_workers(
        req, pricing_mode, offers, workers, taken, core_already, clearing_price, index, least=max(gang, 1)
    )
    if gang and ((aggregator and agg is None) or len(placed.choices) < gang):
        short = Short(gang, placed.choices, placed.wait_reason, agg, aggregator and agg is None)
        return JobPlacement(None, WorkerPlacement((), placed.wait_reason), None, short)
    return JobPlacement(agg, placed, price)


def _place_workers(
    req: Requirements,
    pricing_mode: str,
    offers: Sequence[NodeOffer],
    count: int,
    taken: set[str],
    core_already: int,
    clearing_price: float | None,
    index: OfferIndex | None,
    least: int,
) -> tuple[WorkerPlacement, float | None]:
    """The workers' nodes, and the clearing price if this placement ran the job's auction."""
    if count == 0:
        return WorkerPlacement(()), None
    if pricing_mode == "fixed":
        if index is not None:
            return index.place_workers(req, count=count, exclude=taken, core_already=core_already), None
        return place_workers(req, offers, count=count, exclude=taken, core_already=core_already), None
    if clearing_price is None:
        return pricing.place_auction(req, offers, count=count, exclude=taken, least=least)
    placed = pricing.place_replacement(
        req, offers, clearing_price, count=count, exclude=taken, core_already=core_already
    )
    return placed, None


def start_size(req: Requirements, *, started: bool, placed: int) -> int:
    """The ``gang`` to place a job with: until it has started, the workers it still needs to start
    with (``resources.min_workers`` less those ``placed``); after, none (it takes what it can)."""
    return 0 if started else max(req.start_workers - placed, 0)


def unstaked(offers: Iterable[NodeOffer], bonded: Mapping[str, int], min_stake: int) -> dict[str, Held]:
    """The community nodes with less than ``min_stake`` (micro-credits) bonded, which take no work, and
    why; core nodes are the operator's own and stake nothing."""
    if min_stake <= 0:
        return {}
    bonds = {o.node_id: bonded.get(o.node_id, 0) for o in offers if o.kind == "community"}
    least = f"min_stake {to_credits(min_stake):g} credits"
    return {
        node: Held("stake below min_stake", f"stake {to_credits(b):g} < {least}")
        for node, b in bonds.items()
        if b < min_stake
    }
