"""The market's pure core: which nodes qualify for a job and which get its workers and aggregator.

No I/O: offers come in as frozen values, choices go out with a human-readable reason, so the
coordinator and the simulator run the same code.

- ``matching``  offers, requirements, the reasons an offer does not qualify, worker ranking by
                cost per useful TFLOP (a job's core quota, then community, then core as fallback
                unless the job forbids it), aggregator placement
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

__all__ = [
    "Choice",
    "NodeOffer",
    "Requirements",
    "WorkerPlacement",
    "cost_per_useful_tflop",
    "place_aggregator",
    "place_workers",
    "unmet",
]
