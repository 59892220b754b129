"""The market's pure core: which nodes qualify for a job and which get its workers and aggregator,
how reliable each node has proven, and the query language consumers pick offers with.

No I/O: offers come in as frozen values, choices go out with a human-readable reason, so the
coordinator and the simulator run the same code.

- ``matching``  offers, requirements, the reasons an offer does not qualify, worker ranking by
                cost per useful TFLOP (a job's core quota, then community, then core as fallback
                unless the job forbids it), aggregator placement; no task on a node whose
                offered hours ran out
- ``index``     ``OfferIndex``: the offers ranked once, each requirement an array, so placing workers
                among 100,000 offers takes about a millisecond (the same choices as ``matching``)
- ``reputation`` one reliability score in [0, 1] per node: heartbeat uptime x lease completion x
                audit record, each smoothed by a stated prior (a new node scores 0.675)
- ``query``     the offer query language (``vram>=16 price<=0.5 region in [eu, us]``) and sort
                orders (``price,-reliability``); bad input raises ``QueryError`` with a caret line
- ``pricing``   what nodes are paid: fixed asks, or a sealed-bid reverse auction for the workers
                (k lowest asks win, all paid the (k+1)-th ask: truthful); how long a round takes
- ``memory``    the GPU memory a worker needs, estimated from the model's size, precision and LoRA
                when ``resources.min_vram_gb`` is unset (asked of GPU nodes only)
- ``placement`` ``place_job``: one job's tasks onto free offers as one decision, a job that has not
                started as a gang of its aggregator and ``min_workers`` workers or nothing
- ``waiting``   why a job's tasks wait, node by node (busy, barred, short of stake, the first
                requirement a node fails), in one line at any fleet size
- ``quotes``    what a job would cost and take now, from the offers' benchmarks, with a range; or why
                it cannot be placed
"""

from gpuflex.market.matching import (
    Choice,
    NodeOffer,
    Requirements,
    WorkerPlacement,
    cost_per_useful_tflop,
    place_aggregator,
    place_workers,
    unmet,
)
from gpuflex.market.pricing import Ask, Clearing, clear_auction
from gpuflex.market.quotes import Quote, QuoteNode, quote

__all__ = [
    "Ask",
    "Choice",
    "Clearing",
    "NodeOffer",
    "Quote",
    "QuoteNode",
    "Requirements",
    "WorkerPlacement",
    "clear_auction",
    "cost_per_useful_tflop",
    "place_aggregator",
    "place_workers",
    "quote",
    "unmet",
]
