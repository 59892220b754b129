"""Pure arithmetic of the dashboard: price index, parameter counts and the DDP comparison.

Reliability is the market's reputation score (``gpuflex.market.reputation``), not computed here.

No I/O here, so each is tested directly.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

# DDP's ring all-reduce sends about 2 x the gradient per worker per optimizer step; fp32 is 4 bytes.
DDP_BYTES_PER_PARAM_STEP = 2 * 4


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values (the price index of an empty market)."""
    values = list(values)
    return statistics.median(values) if values else None


def safetensors_params(blob: bytes) -> int:
    """How many numbers a safetensors blob holds, read from its header alone (0 if it is not one)."""
    if len(blob) < 8:
        return 0
    size = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + size])
    except ValueError:
        return 0
    if not isinstance(header, dict):
        return 0
    tensors = (v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))
    return sum(math.prod(t.get("shape", [])) for t in tensors)


def ddp_bytes(params: int, worker_steps: int) -> int:
    """What DDP would have sent for the same work: every worker all-reduces every inner step."""
    return DDP_BYTES_PER_PARAM_STEP * params * worker_steps


@dataclass(frozen=True)
class Traffic:
    """Bytes that crossed the wire for a job, against what DDP would have sent (None: not known yet)."""

    exchanged: int
    ddp: int | None
    params: int | None

    @property
    def saving(self) -> float | None:
        """How many times fewer bytes than DDP."""
        return self.ddp / self.exchanged if self.ddp and self.exchanged else None
