"""Placement: one job's unplaced tasks onto free offers, as one decision (aggregator, then workers).

The coordinator's ``services.market.place_pending`` turns rows into offers and writes this decision
back; the simulator (``gpuflex.sim``) hands it a pre-filtered candidate set. Both call this function,
so the rules below are the ones the network runs:

- the aggregator first, on the cheapest eligible core node (``matching.place_aggregator``);
- then the workers, on the nodes left: by rank at the nodes' own prices (``pricing: fixed``); an
  auction job by its auction the first time (which sets its clearing price), then each replacement
  among the nodes asking at most that price (``pricing.place_replacement``);
- a community node below the governed ``min_stake`` takes no work (``staked``).
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


@dataclass(frozen=True)
class JobPlacement:
    aggregator: Choice | None  # None: no aggregator was asked for, or none qualifies
    workers: WorkerPlacement
    clearing_price: float | None  # an auction that cleared just now sets the job's price; else None

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
) -> JobPlacement:
    """Place the job's aggregator (when ``aggregator``) and ``workers`` workers on nodes not in ``busy``.

    ``core_already``: the job's workers already on core nodes (they count toward its core quota);
    ``clearing_price``: the job's auction price if its auction already cleared; ``index``: the same
    offers indexed (``market.index``), which places fixed-price workers without a scan: the coordinator
    builds one per pass, since a scan of 100,000 offers per job is too slow.
    """
    agg = place_aggregator(req, offers, exclude=busy) if aggregator else None
    taken = busy | {agg.node_id} if agg else busy
    if workers == 0:
        return JobPlacement(agg, WorkerPlacement(()), None)
    if pricing_mode == "fixed":
        if index is not None:
            placed = index.place_workers(req, count=workers, exclude=taken, core_already=core_already)
        else:
            placed = place_workers(req, offers, count=workers, exclude=taken, core_already=core_already)
        return JobPlacement(agg, placed, None)
    if clearing_price is None:
        placed, price = pricing.place_auction(req, offers, count=workers, exclude=taken)
        return JobPlacement(agg, placed, price)
    placed = pricing.place_replacement(
        req, offers, clearing_price, count=workers, exclude=taken, core_already=core_already
    )
    return JobPlacement(agg, placed, None)


def staked(offers: Iterable[NodeOffer], bonded: Mapping[str, int], min_stake: int) -> list[NodeOffer]:
    """The offers that may take work: core nodes, and community nodes with ``min_stake`` bonded."""
    if min_stake <= 0:
        return list(offers)
    return [o for o in offers if o.kind == "core" or bonded.get(o.node_id, 0) >= min_stake]
