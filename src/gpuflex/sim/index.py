"""The candidate index: free online nodes per requirement class, each kept in the market's rank order,
so one placement looks at a handful of nodes instead of a million.

The coordinator hands ``market.placement.place_job`` every free online offer; the simulator hands it
the best few of each pool the job could draw from, ranked by the market's own rank functions
(``matching.worker_rank``, ``matching.aggregator_rank``, ``pricing.ask_rank``) and filtered by its own
checks (``matching.unmet``, ``matching.can_aggregate``, run once per node profile). Taking ``w`` workers
needs at most the ``w`` best community nodes and the ``w + 1`` best core nodes (one may become the
aggregator); an auction also needs the next ask, its price; so ``place_job`` makes the choice it would
make among all nodes. Only its reasons' counts ("rank 1 of N") differ.

A pool is a few heaps, merged as they are read: nodes that qualify for the same set of classes share
one heap per role (workers, asks, aggregators), so a free node is pushed once per role however many
classes it serves, and taking it pops its one entry instead of leaving stale copies in the pools of
the other classes. The heaps delete lazily: a node taken or gone bumps its version, and stale entries
are dropped when they surface (or when the heaps are compacted).
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
Heap = list[Entry]
REPLACEMENT_POOL = 64  # an auction job's replacement is ranked among this many of the cheapest asks


@dataclass(frozen=True)
class Pools:
    """Where a free node of one profile is listed: one heap of worker ranks, one of asks, one of
    aggregator ranks (each None when it qualifies for no class that needs it), and the classes those
    serve. Profiles that qualify for the same classes share heaps, so a node is listed once per role
    whatever the number of classes it serves, and its entry is gone once a placement takes it."""

    workers: Heap | None
    asks: Heap | None
    aggregators: Heap | None
    worker_classes: tuple[int, ...]
    aggregator_classes: tuple[int, ...]


@dataclass(frozen=True)
class Candidates:
    offers: list[NodeOffer]
    taken: list[tuple[Heap, Entry]]  # every entry popped, with its heap, to give back


class CandidateIndex:
    def __init__(self, pop: Population, classes: list[Requirements], auction: list[bool]):
        self.pop = pop
        n_classes = len(classes)
        # per class, the heaps that list its candidates (a class draws from every heap of a set of
        # classes it belongs to)
        self.community: list[list[Heap]] = [[] for _ in range(n_classes)]
        self.core: list[list[Heap]] = [[] for _ in range(n_classes)]
        self.asks_community: list[list[Heap]] = [[] for _ in range(n_classes)]
        self.asks_core: list[list[Heap]] = [[] for _ in range(n_classes)]
        self.aggregators: list[list[Heap]] = [[] for _ in range(n_classes)]
        self._heaps: list[Heap] = []
        shared: dict[tuple, Heap] = {}

        def heap(key: tuple, serves: list[list[Heap]], classes: tuple[int, ...]) -> Heap | None:
            if not classes:
                return None
            if key not in shared:
                shared[key] = []
                self._heaps.append(shared[key])
                for c in classes:
                    serves[c].append(shared[key])
            return shared[key]

        self._pools = []
        for offer in pop.profiles:
            core = offer.kind == "core"
            workers = tuple(c for c, req in enumerate(classes) if not unmet(offer, req))
            asks = tuple(c for c in workers if auction[c])
            aggregators = tuple(c for c, req in enumerate(classes) if can_aggregate(offer, req))
            pools = (self.core, self.asks_core) if core else (self.community, self.asks_community)
            self._pools.append(
                Pools(
                    heap(("workers", core, workers), pools[0], workers),
                    heap(("asks", core, asks), pools[1], asks),
                    heap(("aggregators", aggregators), self.aggregators, aggregators),
                    workers,
                    aggregators,
                )
            )
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

    def add(self, i: int, reliability: float) -> None:
        """Node ``i`` is free and online, at this reliability (its reputation score now)."""
        if self.free[i]:
            self.remove(i)
        self.free[i] = True
        self.n_free += 1
        version = self.version[i]
        offer = self.offers[i] = self.pop.offer(i, reliability=reliability)
        pools = self._pools[self.profile[i]]
        if pools.workers is not None:
            self.gained_workers.update(pools.worker_classes)
            heapq.heappush(pools.workers, (*worker_rank(offer), i, version))
            if pools.asks is not None:
                ask = Ask(offer.node_id, offer.price_per_hour, cost_per_useful_tflop(offer))
                heapq.heappush(pools.asks, (*ask_rank(ask), i, version))
        if pools.aggregators is not None:
            self.gained_aggregators.update(pools.aggregator_classes)
            heapq.heappush(pools.aggregators, (*aggregator_rank(offer), i, version))
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
        self, heaps: list[Heap], count: int, taken: list, seen: set[int], max_price: float, by_price: bool
    ) -> int:
        """Pop the best live entries of ``heaps`` (merged: the best top first) until ``count`` at most
        ``max_price`` are found; returns how many were. In heaps ordered by price (``by_price``: asks),
        the first entry above it ends the search."""
        found = 0
        price, free, version, pop = self.price, self.free, self.version, heapq.heappop
        while found < count:
            best = None
            for heap in heaps:
                while heap and not (free[heap[0][-2]] and version[heap[0][-2]] == heap[0][-1]):
                    pop(heap)  # stale: its node was taken or went away
                if heap and (best is None or heap[0] < best[0]):
                    best = heap
            if best is None:
                break
            entry = pop(best)
            taken.append((best, entry))
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
        taken: list[tuple[Heap, Entry]] = []
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
        for heap in self._heaps:
            heap[:] = [e for e in heap if self._valid(e)]
            heapq.heapify(heap)
        self._pushed = 0
