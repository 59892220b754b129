"""The chaos suite's knobs: a seeded fault schedule, and how hard to push (``--soak``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

DEFAULT_SEED = 20261123


@dataclass(frozen=True)
class Chaos:
    rng: random.Random
    seed: int
    scale: int  # 1 in CI; more rounds and more faults with --soak

    def moment(self, first: int, last: int, count: int) -> list[int]:
        """``count`` distinct rounds in [first, last] at which to strike, in order."""
        return sorted(self.rng.sample(range(first, last + 1), count))


@pytest.fixture
def chaos(request) -> Chaos:
    seed = request.config.getoption("--chaos-seed")
    seed = DEFAULT_SEED if seed is None else seed
    scale = 4 if request.config.getoption("--soak") else 1
    print(f"chaos seed {seed}, scale {scale} (replay: pytest tests/chaos --chaos-seed {seed})")
    return Chaos(random.Random(f"{seed}:{request.node.name}"), seed, scale)
