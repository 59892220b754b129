"""Shared pieces of the serve tests: a thread count held for a while, and outputs generated in batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from gpuflex.serve.engine import Completion, Engine
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams


@contextmanager
def threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` for a while: another thread count sums in another order."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def generate(
    served: ServedModel,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    batch: int,
    threads_n: int = 1,
) -> list[Completion]:
    """Each prompt's completion, all submitted at once to an engine batching up to ``batch``."""
    with threads(threads_n), Engine(served, max_batch=batch) as engine:
        requests = [engine.submit(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        return [r.result(timeout=60) for r in requests]
