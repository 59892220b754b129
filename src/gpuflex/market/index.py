"""An index of offers that places a job's workers among 100,000 offers in about a millisecond.

``matching.place_workers`` checks every offer in Python and sorts the qualifying ones for every job:
fine for a few hundred nodes, tens of milliseconds at 10,000 and far more at 100,000. ``OfferIndex``
sorts the offers once, by the workers' rank (cost per useful TFLOP, then price, then node id), and keeps
each requirement's column as an array in that order: a query is a few vectorized comparisons, a count
of what qualifies, and the first qualifying offers of each kind in rank order — no sort, no loop over
offers in Python. Accelerator names (substring matches) and regions are checked once per distinct
value, not once per offer. It chooses exactly what ``place_workers`` chooses, reasons included (a
property test holds it to that); one offer per node. It also says, in the same few comparisons, why
each offer cannot take a task (``reasons``): ``market.waiting`` tells a waiting job that, node by node.

Pure, like ``matching``: the coordinator builds one per placement pass, the simulator may keep one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from gpuflex.errors import BadRequest
from gpuflex.market.matching import (
    AGGREGATOR_CHECKS,
    WORKER_CHECKS,
    Check,
    NodeOffer,
    Ranked,
    Requirements,
    WorkerPlacement,
    _accelerator,
    _available,
    _devices,
    _kernels,
    _price,
    _region,
    _tflops,
    _vram,
    worker_rank,
)

# ``reasons``' codes besides a failed check's (``FAILS + i``: the role's i-th check of ``matching``)
NOT_CANDIDATE, FITS, HELD, FAILS = -1, 0, 1, 2


class OfferIndex:
    def __init__(self, offers: Iterable[NodeOffer]):
        self.offers = sorted(offers, key=worker_rank)
        self.position = {o.node_id: i for i, o in enumerate(self.offers)}
        if len(self.position) != len(self.offers):
            raise ValueError("an OfferIndex holds one offer per node")
        self.price = self._column(lambda o: o.price_per_hour)
        self.vram = self._column(lambda o: o.vram_gb)
        self.tflops = self._column(lambda o: o.tflops)
        self.hours = self._column(lambda o: np.nan if o.hours_left is None else o.hours_left)
        self.core = self._column(lambda o: o.kind == "core", bool)
        self.gpu = self.vram > 0  # what ``matching`` holds to the job's VRAM estimate
        self.available = np.isnan(self.hours) | (self.hours > 0)
        self.free = np.ones(len(self.offers), dtype=bool)
        self.regions, self.region = self._codes(o.region.casefold() for o in self.offers)
        self.gpu_sets, self.gpus = self._codes(o.gpus for o in self.offers)
        self.gpu_count = self._column(lambda o: len(o.gpus))
        self.kernel_sets, self.kernels = self._codes(o.kernels for o in self.offers)

    def __len__(self) -> int:
        return len(self.offers)

    def _column(self, value: Callable[[NodeOffer], float | bool], dtype: type = float) -> np.ndarray:
        return np.fromiter((value(o) for o in self.offers), dtype, len(self.offers))

    @staticmethod
    def _codes(values: Iterable) -> tuple[list, np.ndarray]:
        """The distinct values and, per offer, the index of its value among them."""
        distinct: dict = {}
        codes = [distinct.setdefault(v, len(distinct)) for v in values]
        return list(distinct), np.asarray(codes, dtype=np.int32)

    def set_busy(self, node_ids: Iterable[str], busy: bool = True) -> None:
        """Keep the nodes that run or were given a task out of every query (kept in sync by the holder,
        so a query pays only for the few nodes its own ``exclude`` adds)."""
        self.free[self.positions(node_ids)] = not busy

    def positions(self, node_ids: Iterable[str]) -> np.ndarray:
        """The places of these nodes' offers in rank order (nodes without an offer are left out)."""
        return np.asarray([self.position[n] for n in node_ids if n in self.position], dtype=np.intp)

    def failing(self, req: Requirements, check: Check) -> np.ndarray | None:
        """Which offers, in rank order, one of ``matching``'s checks finds a reason against (None: none)."""
        if check is _available:
            return ~self.available
        if check is _price:
            return ~(self.price <= req.max_price_per_hour)  # written so that NaN fails too
        if check is _vram:
            return ~(self.vram >= np.where(self.gpu, req.vram_needed(True), req.vram_needed(False)))
        if check is _devices:
            return None if req.devices <= 1 else self.gpu & (self.gpu_count < req.devices)
        if check is _kernels:
            if not req.kernels:
                return None
            fits = [i for i, kernels in enumerate(self.kernel_sets) if set(req.kernels) <= set(kernels)]
            return ~_table(len(self.kernel_sets), fits)[self.kernels]
        if check is _tflops:
            return ~(self.tflops >= req.min_tflops)
        if check is _region:
            if req.region is None:
                return None
            wanted = req.region.casefold()
            return ~_table(len(self.regions), [i for i, r in enumerate(self.regions) if r == wanted])[
                self.region
            ]
        if check is _accelerator:
            if not req.accelerators:
                return None
            fits = [i for i, gpus in enumerate(self.gpu_sets) if _fits_gpus(gpus, req)]
            return ~_table(len(self.gpu_sets), fits)[self.gpus]
        raise ValueError(f"the index has no column for check {check.__name__}")

    def qualifying(self, req: Requirements, exclude: set[str]) -> np.ndarray:
        """Which offers, in rank order, may host a worker of ``req`` (``matching.unmet`` is empty) and
        are neither busy nor in ``exclude``."""
        ok = self.free.copy()
        for check in WORKER_CHECKS:
            if (fails := self.failing(req, check)) is not None:
                ok &= ~fails
        ok[self.positions(exclude)] = False
        return ok

    def reasons(self, req: Requirements, *, aggregator: bool, held: Iterable[str]) -> np.ndarray:
        """Per offer in rank order, why it cannot take a worker of ``req`` (``aggregator``: host its
        aggregator) now: ``HELD`` (busy here or in ``held``), else ``FAILS + i`` for the first of the
        role's checks (``matching.WORKER_CHECKS`` or ``AGGREGATOR_CHECKS``) it fails, else ``FITS``;
        ``NOT_CANDIDATE`` for a community node asked for an aggregator."""
        checks: Sequence[Check] = AGGREGATOR_CHECKS if aggregator else WORKER_CHECKS
        code = np.full(len(self.offers), FITS, dtype=np.int8)
        for i in reversed(range(len(checks))):  # the first failing check is the one told
            if (fails := self.failing(req, checks[i])) is not None:
                code[fails] = FAILS + i
        code[~self.free] = HELD
        code[self.positions(held)] = HELD
        if aggregator:
            code[~self.core] = NOT_CANDIDATE
        return code

    def place_workers(
        self, req: Requirements, *, count: int, exclude: set[str], core_already: int = 0
    ) -> WorkerPlacement:
        """What ``matching.place_workers(req, offers, exclude=busy | exclude, …)`` returns."""
        if count < 0:
            raise BadRequest(f"worker count must be >= 0, got {count}")
        ok = self.qualifying(req, exclude)
        community, core = np.flatnonzero(ok & ~self.core), np.flatnonzero(ok & self.core)
        ranked = Ranked(
            [self.offers[i] for i in community[:count]],
            len(community),
            [self.offers[i] for i in core[:count]],
            len(core),
        )
        return ranked.placement(req, count, core_already)


def _fits_gpus(gpus: tuple[str, ...], req: Requirements) -> bool:
    probe = NodeOffer("", "", "community", 0.0, 0.0, 0.0, gpus, "")
    return _accelerator(probe, req) is None


def _table(size: int, true_at: list[int]) -> np.ndarray:
    """A lookup table over the distinct values of a column: gathering it by the codes filters the column."""
    table = np.zeros(size, dtype=bool)
    table[true_at] = True
    return table
