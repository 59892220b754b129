"""Which owners a federated job (``data.federated: NAME``) trains on, and why each node was or was not used.

A federated job's data never leaves its owners, so its workers cannot be placed by price: one worker
goes to each online node that offers a private dataset named NAME and admits the job's account
(``gpuflex provider start --private-data NAME=DIR --allow-consumer ACCOUNT``), and that worker may only
ever run there (``home_reason``; while its owner is away or busy it waits, ``waiting_reason``).
``resources.workers`` is ignored: the job gets as many workers as it
has owners at submit. Of the market's requirements only the region and the price cap apply (an owner
outside ``resources.region`` is not used: data residency holds for an owner's data as for uploaded data;
nor is one asking more than ``max_price_per_hour``): the data decides where a worker runs, not its
hardware. Every
node that was considered gets a reason a person can read, so a consumer whose job has fewer owners than
expected sees why.

Pure functions over frozen values: the coordinator turns node rows into ``OwnerNode``s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuflex.errors import BadRequest


@dataclass(frozen=True)
class OfferedDataset:
    """A private dataset as its owner announced it."""

    name: str
    tokens: int  # its train split's: the owner's FedAvg weight
    shards: int
    manifest: str  # sha256 of its manifest: the owner's worker checks its data against it


@dataclass(frozen=True)
class OwnerNode:
    """An online node, with what it offers of private data and whom it admits."""

    node_id: str
    name: str
    datasets: tuple[OfferedDataset, ...]
    consumers: frozenset[str]
    price_per_hour: float = 0.0  # credits per hour
    region: str = ""


@dataclass(frozen=True)
class Owner:
    """A node a federated job's worker runs on, and the dataset it trains on there."""

    node_id: str
    name: str
    dataset: OfferedDataset


@dataclass(frozen=True)
class Owners:
    used: tuple[Owner, ...]
    reasons: tuple[str, ...]  # one per node considered: used, or why not


def choose_owners(
    dataset: str,
    consumer: str,
    nodes: Sequence[OwnerNode],
    max_price_per_hour: float = math.inf,
    region: str | None = None,
) -> Owners:
    """The owners of ``dataset`` among ``nodes`` that admit ``consumer``, lie in ``region`` (any, if
    None) and ask at most ``max_price_per_hour``, in node id order, with a reason per node that offers
    any private data; BadRequest (one line) when none qualifies."""
    used, reasons = [], []
    offering = admitted = in_region = False
    for node in sorted(nodes, key=lambda n: n.node_id):
        if not node.datasets:
            continue  # offers no private data at all: not worth a line per node of the market
        offered = next((d for d in node.datasets if d.name == dataset), None)
        who = f"{node.name} ({node.node_id})"
        if offered is None:
            reasons.append(f"{who}: not used: offers no dataset {dataset}")
            continue
        offering = True
        if consumer not in node.consumers:
            reasons.append(f"{who}: not used: does not admit consumer {consumer}")
            continue
        admitted = True
        if region is not None and node.region.casefold() != region.casefold():
            reasons.append(
                f"{who}: not used: in region {node.region or '(none)'}; resources.region keeps the job's "
                f"data in {region}"
            )
            continue
        in_region = True
        if node.price_per_hour > max_price_per_hour:
            reasons.append(
                f"{who}: not used: asks {node.price_per_hour:.3f} credits/h, more than max_price_per_hour "
                f"{max_price_per_hour:.3f}"
            )
            continue
        used.append(Owner(node.node_id, node.name, offered))
        reasons.append(f"{who}: used: offers {dataset} ({offered.tokens:,} tokens) and admits {consumer}")
    if not offering:
        raise BadRequest(
            f"data.federated: no online node offers a private dataset named {dataset!r} "
            "(its owners start their providers with --private-data NAME=DIR)"
        )
    if not admitted:
        raise BadRequest(
            f"data.federated: no online owner of {dataset!r} admits account {consumer!r} "
            "(an owner admits an account with --allow-consumer ACCOUNT)"
        )
    if not in_region:
        raise BadRequest(
            f"data.federated: no online owner of {dataset!r} that admits {consumer!r} is in region "
            f"{region!r} (resources.region): the job's data may not be used outside it"
        )
    if not used:
        raise BadRequest(
            f"data.federated: every online owner of {dataset!r} that admits {consumer!r} asks more than "
            f"max_price_per_hour {max_price_per_hour:.3f} credits/h: raise it to use them"
        )
    return Owners(tuple(used), tuple(reasons))


def home_reason(owner_name: str, dataset: str, tokens: int) -> str:
    """Why a federated worker is placed where it is: the only node that holds its data."""
    return f"owner {owner_name} of {dataset} ({tokens:,} tokens): the only node that holds this worker's data"


def waiting_reason(owner_name: str, why: str) -> str:
    """Why a federated worker waits: it cannot move off its owner's node."""
    return f"waits for its owner {owner_name} ({why}): its data is there and nowhere else"
