"""Why a job's tasks wait, node by node: what placement could not do, told so a person can act on it
(``gpuflex job show``, the job's log and page, ``gpuflex quote``, ``gpuflex submit``).

Placement (``placement.place_job``) decides from counts; this names the nodes. Each online node that
takes no task of the job is told with its first reason: held (busy with a lease or a placed task,
barred from the job by a guilty verdict, short of the governed ``min_stake``: the caller says which,
as ``Held``), else the first requirement it fails (``matching``'s checks, in their words), else — fit
and free, yet left out — the job's own core rules. The first ``NAMED`` are named, in rank order; the
rest are counted by kind, so a reason stays one line at 100,000 nodes (``OfferIndex.reasons`` finds
them all in a few vectorized comparisons).

Pure, like the rest of ``market``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gpuflex.market.index import FAILS, FITS, HELD, NOT_CANDIDATE, OfferIndex
from gpuflex.market.matching import AGGREGATOR_CHECKS, CHECK_KINDS, WORKER_CHECKS, NodeOffer, Requirements

if TYPE_CHECKING:  # placement imports this module
    from gpuflex.market.placement import JobPlacement

NAMED = 6  # nodes named in a reason; the rest are counted


@dataclass(frozen=True)
class Held:
    """A node that takes no task of the job now, whatever it offers."""

    kind: str  # how such nodes are counted: "busy", "barred", "stake below min_stake"
    reason: str  # told beside the node's name: "busy (worker, leased)"


BUSY = Held("busy", "busy")  # a node the index holds busy, when the caller says no more


def busy_with(how: str, role: str) -> Held:
    """A node ``how`` ("placed" or "leased") as some job's ``role``: which job stays unsaid, as a consumer
    sees only its own work."""
    return Held("busy", f"busy ({role}, {how})")


_KEPT = Held("kept for the aggregator", "kept for this job's aggregator")
_CORE_RULES = "left out by the job's core rules"


@dataclass(frozen=True)
class Waiting:
    """Why some of a job's tasks wait: what is short (``headline``), then each node left out and why."""

    headline: str
    nodes: str

    def __str__(self) -> str:
        return f"{self.headline}: {self.nodes}"


def why_waiting(
    index: OfferIndex,
    req: Requirements,
    placement: JobPlacement,
    *,
    aggregator: bool,
    workers: int,
    held: Mapping[str, Held],
) -> tuple[Waiting | None, Waiting | None]:
    """Why, after ``placement`` of ``workers`` workers and (``aggregator``) the job's aggregator, the
    aggregator waits, and why the workers left unplaced wait; None for what does not wait.

    ``index``: every online offer; ``held``: the nodes that take no task of this job, and why,
    including those ``placement`` chose (the caller holds them as it writes them down)."""
    short = placement.short
    if short is not None:  # the job has not started: everything waits for the same reason
        parts, nodes = [], []
        if short.no_aggregator:
            parts.append("no core node can host the aggregator")
            nodes.append(nodes_left_out(index, req, aggregator=True, held=held))
        if len(short.workers) < short.needed:
            could = [index.offers[index.position[c.node_id]].name for c in short.workers]
            parts.append(_too_few(short.needed, could, short.wait_reason))
            if short.aggregator is not None:  # a copy: a dict's lookups are C, a ChainMap's Python
                held = {**held, short.aggregator.node_id: _KEPT}
            chosen = [c.node_id for c in short.workers]
            nodes.append(nodes_left_out(index, req, aggregator=False, held=held, chosen=chosen))
        if len(parts) == 2:
            nodes = [f"aggregator: {nodes[0]}", f"workers: {nodes[1]}"]
        reason = Waiting(", and ".join(parts), "; ".join(nodes))
        return (reason if aggregator else None), reason
    agg = None
    if aggregator and placement.aggregator is None:
        agg = Waiting(
            "no core node can host the aggregator", nodes_left_out(index, req, aggregator=True, held=held)
        )
    left = None
    if len(placement.workers.choices) < workers:
        headline = placement.workers.wait_reason or "no free node qualifies"
        left = Waiting(headline, nodes_left_out(index, req, aggregator=False, held=held))
    return agg, left


def _too_few(needed: int, could: list[str], wait_reason: str | None) -> str:
    on = f" (on {_names(could)})" if could else ""
    why = f"; {wait_reason}" if wait_reason else ""
    return (
        f"{len(could)} of the {needed} workers this job needs to start (resources.min_workers) "
        f"can be placed now{on}{why}"
    )


def _names(items: list[str]) -> str:
    more = f" and {len(items) - NAMED} more" if len(items) > NAMED else ""
    return ", ".join(items[:NAMED]) + more


def nodes_left_out(
    index: OfferIndex,
    req: Requirements,
    *,
    aggregator: bool,
    held: Mapping[str, Held],
    chosen: Collection[str] = (),
) -> str:
    """Each online node but ``chosen`` that cannot take a worker of ``req`` (``aggregator``: host its
    aggregator; only core nodes are told) and why: the first ``NAMED`` in rank order by name, the rest
    counted by kind. ``held``: nodes that take no task of the job, with why (else the index's busy
    nodes are plain "busy")."""
    codes = index.reasons(req, aggregator=aggregator, held=held)
    codes[index.positions(chosen)] = NOT_CANDIDATE
    listed = np.flatnonzero(codes != NOT_CANDIDATE)
    what = "core node" if aggregator else "node"
    if listed.size == 0:
        return f"no other {what} is online" if len(chosen) else f"no {what} is online"
    checks = AGGREGATOR_CHECKS if aggregator else WORKER_CHECKS

    def told(i: int) -> tuple[str, str]:  # (kind, reason)
        offer, code = index.offers[i], int(codes[i])
        if code == HELD:
            h = held.get(offer.node_id, BUSY)
            return h.kind, h.reason
        if code == FITS:
            return _left_out(offer, req)
        check = checks[code - FAILS]
        return CHECK_KINDS[check], check(offer, req) or ""

    out = [f"{index.offers[i].name}: {told(i)[1]}" for i in listed[:NAMED]]
    rest = listed[NAMED:]
    if rest.size:
        kinds: Counter[str] = Counter()
        for code, n in zip(*np.unique(codes[rest], return_counts=True), strict=True):
            if code == HELD:  # counted by what holds each: one look a node, only here
                offers = index.offers
                kinds.update(
                    held.get(offers[i].node_id, BUSY).kind for i in rest[codes[rest] == code].tolist()
                )
            elif code == FITS:
                kinds.update(told(i)[0] for i in rest[codes[rest] == code].tolist())
            else:
                kinds[CHECK_KINDS[checks[code - FAILS]]] += int(n)
        counted = ", ".join(f"{n:,} {kind}" for kind, n in kinds.most_common())
        out.append(f"and {rest.size:,} more: {counted}")
    return ", ".join(out)


def _left_out(offer: NodeOffer, req: Requirements) -> tuple[str, str]:
    """Why a free node that meets every requirement took no worker, as (kind, reason): the job's core
    rules, or nothing (an auction that could not clear leaves every node free)."""
    if offer.kind == "core" and not req.core_fallback:
        return (
            _CORE_RULES,
            "free, but a core node, and the job forbids core fallback (resources.core_fallback)",
        )
    if offer.kind == "community" and req.min_core_workers:
        return (
            _CORE_RULES,
            "free, but the job's other workers must run on core nodes (resources.min_core_workers)",
        )
    return "free", "free"
