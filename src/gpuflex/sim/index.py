"""The candidate index: free online nodes per requirement class, each kept in the market's rank order,
so one placement looks at a handful of nodes instead of a million.

The coordinator hands ``market.placement.place_job`` every free online offer; the simulator hands it
the best few of each pool the job could draw from, ranked by the market's own rank functions
(``matching.worker_rank``, ``matching.aggregator_rank``, ``pricing.ask_rank``) and filtered by its own
checks (``matching.unmet``, ``matching.can_aggregate``, run once per node profile). Taking ``w`` workers
needs at most the ``w`` best community nodes and the ``w + 1`` best core nodes (one may become the
aggregator); an auction also needs the next ask, its price; so ``place_job`` makes the choice it would
make among all nodes. Only its reasons' counts ("rank 1 of N") differ.

Each pool is a heap with lazy deletion: a node taken or gone bumps its version, and stale entries are
dropped when they surface (or when the heaps are compacted).
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

from gpuflex.market.matching import (
    NodeOffer,
    Requirements,
    aggregator_rank,
    can_aggregate,
    cost_per_useful_tflop,
    unmet,
    worker_rank,
)
from gpuflex.market.pricing import Ask, ask_rank
from gpuflex.sim.population import Population

Entry = tuple  # (*rank, node, version): flat, so the heaps compare plain numbers first
REPLACEMENT_POOL = 64  # an auction job's replacement is ranked among this many of the cheapest asks


@dataclass(frozen=True)
class Candidates:
    offers: list[NodeOffer]
    taken: list[tuple[list[Entry], Entry]]  # every entry popped, with its heap, to give back


class CandidateIndex:
    def __init__(self, pop: Population, classes: list[Requirements], auction: list[bool]):
        self.pop = pop
        self.auction = auction
        n_classes = len(classes)
        self.worker_classes = [
            [c for c, req in enumerate(classes) if not unmet(p, req)] for p in pop.profiles
        ]
        self.aggregator_classes = [
            [c for c, req in enumerate(classes) if can_aggregate(p, req)] for p in pop.profiles
        ]
        self.community: list[list[Entry]] = [[] for _ in range(n_classes)]
        self.core: list[list[Entry]] = [[] for _ in range(n_classes)]
        self.asks_community: list[list[Entry]] = [[] for _ in range(n_classes)]
        self.asks_core: list[list[Entry]] = [[] for _ in range(n_classes)]
        self.aggregators: list[list[Entry]] = [[] for _ in range(n_classes)]
        # per node, flat (as the engine's: ``Simulation.__init__``)
        self.price = array("d", pop.price.tolist())
        self.profile = array("q", pop.profile.tolist())
        self.version = array("q", [0]) * pop.n
        self.free = bytearray(pop.n)
        self.offers: list[NodeOffer | None] = [None] * pop.n  # the free nodes', as they were put on offer
        self.n_free = 0
        self._pushed = 0
        # classes whose pools gained a node since the engine last looked: worth another placement try
        self.gained_workers: set[int] = set()
        self.gained_aggregators: set[int] = set()

    def _heaps(self) -> list[list[Entry]]:
        return [*self.community, *self.core, *self.asks_community, *self.asks_core, *self.aggregators]

    def add(self, i: int, reliability: float) -> None:
        """Node ``i`` is free and online, at this reliability (its reputation score now)."""
        if self.free[i]:
            self.remove(i)
        self.free[i] = True
        self.n_free += 1
        version = self.version[i]
        offer = self.offers[i] = self.pop.offer(i, reliability=reliability)
        profile = self.profile[i]
        core = i < self.pop.n_core
        heaps, asks = (self.core, self.asks_core) if core else (self.community, self.asks_community)
        entry = (*worker_rank(offer), i, version)
        ask = None
        classes = self.worker_classes[profile]
        self.gained_workers.update(classes)
        for c in classes:
            heapq.heappush(heaps[c], entry)
            if self.auction[c]:
                if ask is None:
                    rank = ask_rank(Ask(offer.node_id, offer.price_per_hour, cost_per_useful_tflop(offer)))
                    ask = (*rank, i, version)
                heapq.heappush(asks[c], ask)
        if classes := self.aggregator_classes[profile]:
            self.gained_aggregators.update(classes)
            aggregator = (*aggregator_rank(offer), i, version)
            for c in classes:
                heapq.heappush(self.aggregators[c], aggregator)
        self._pushed += 1
        if self._pushed > self.pop.n + 1000:
            self._compact()

    def remove(self, i: int) -> None:
        """Node ``i`` was taken or went away: its entries go stale."""
        if self.free[i]:
            self.free[i] = False
            self.n_free -= 1
            self.version[i] += 1
            self.offers[i] = None

    def _valid(self, entry: Entry) -> bool:
        i, version = entry[-2], entry[-1]
        return self.free[i] and self.version[i] == version

    def _take(
        self, heap: list[Entry], count: int, taken: list, seen: set[int], max_price: float, by_price: bool
    ) -> int:
        """Pop until ``count`` live entries at most ``max_price`` are found; returns how many were.
        In a heap ordered by price (``by_price``: asks), the first entry above it ends the search."""
        found = 0
        price = self.price
        while heap and found < count:
            entry = heapq.heappop(heap)
            if not self._valid(entry):
                continue
            taken.append((heap, entry))
            if price[entry[-2]] <= max_price:
                seen.add(entry[-2])
                found += 1
            elif by_price:
                break
        return found

    def candidates(
        self,
        c: int,
        *,
        aggregator: bool,
        workers: int,
        all_workers: int,
        auction: bool,
        clearing: float | None,
        need_core: bool,
        max_price: float,
    ) -> Candidates:
        """The nodes ``place_job`` needs to see to place a job of class ``c`` as it would among all.

        - the aggregator: the cheapest eligible core node;
        - workers at fixed prices: the ``workers`` best community nodes by rank, and the ``workers + 1``
          best core nodes when those fall short or the job's core quota (``need_core``) wants them;
        - a first auction (``auction``, ``clearing`` None): the ``workers + 1`` lowest community
          asks, and core asks when community ones can't fill all ``all_workers``;
        - an auction's replacements: by rank among the nodes asking at most ``clearing``, of which the
          ``REPLACEMENT_POOL`` cheapest are looked at (the one approximation: a cheaper node beyond
          them, with a better rank, would be missed).
        """
        taken: list[tuple[list[Entry], Entry]] = []
        seen: set[int] = set()
        if aggregator:
            self._take(self.aggregators[c], 1, taken, seen, max_price, False)
        if not workers:
            pass
        elif auction and clearing is None:
            found = self._take(self.asks_community[c], workers + 1, taken, seen, max_price, True)
            if found < all_workers:
                self._take(self.asks_core[c], workers + 2, taken, seen, max_price, True)
        elif auction:
            limit = max(REPLACEMENT_POOL, 2 * workers)
            found = self._take(self.asks_community[c], limit, taken, seen, clearing, True)
            if found < workers or need_core:
                self._take(self.asks_core[c], limit, taken, seen, clearing, True)
        else:
            found = self._take(self.community[c], workers, taken, seen, max_price, False)
            if found < workers or need_core:
                self._take(self.core[c], workers + 1, taken, seen, max_price, False)
        offers = [self.offers[i] for i in sorted(seen)]
        return Candidates(offers, taken)

    def give_back(self, candidates: Candidates, chosen: set[int]) -> None:
        """Entries of nodes not chosen go back where they came from."""
        for heap, entry in candidates.taken:
            if entry[-2] not in chosen:
                heapq.heappush(heap, entry)

    def _compact(self) -> None:
        """Drop stale entries from every heap (they pile up as nodes come and go)."""
        for heap in self._heaps():
            heap[:] = [e for e in heap if self._valid(e)]
            heapq.heapify(heap)
        self._pushed = 0
