"""How a request's next token is chosen, reproducibly from (seed, output position) alone.

Sampling is Gumbel-max: the token at output position i is the argmax of ``logits / T + g``, with ``g``
Gumbel noise drawn from a generator seeded by a hash of (seed, i) and restricted to the top-p nucleus
(which is exactly a draw from the softmax at temperature T). Two properties follow, and both are why:

- a request resumed after k tokens (its prompt plus the k tokens already sent, the same seed) continues
  with exactly the tokens the uninterrupted run would have drawn: position i's noise does not depend on
  what was drawn before it, nor on the batch the request shared (failover relies on this);
- a verifier holding the same logits replays every draw, and when its logits differ a little from the
  provider's (threads, batch, device), how close a claimed token came to being drawn is a gap in logits
  between two scores, local to that position (``gaps``), not a drift accumulated over a vocabulary.

The noise is drawn on the CPU in float64 whatever device computed the logits, so it is the same
everywhere. Temperature 0 is greedy: the argmax of the logits, no noise.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from gpuflex.errors import BadRequest

MAX_TEMPERATURE = 2.0  # OpenAI's range
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings, checked on construction (a ``BadRequest`` naming the field)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()  # strings that end the output; the text stops before the first one
    seed: int | None = None  # None: ``seeded()`` draws one, reported back so the output can be verified

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise BadRequest(
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, not {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be greater than 0 and at most 1, not {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be an integer of at least 1, not {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise BadRequest(f"stop must hold non-empty strings, not {self.stop!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise BadRequest(f"seed must be an integer from 0 to 2**64 - 1, not {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seeded(self) -> SamplingParams:
        """These settings with a seed: their own, or a fresh random one."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for output position ``position`` of a request seeded ``seed`` (splitmix64's finalizer
    over both: neighbouring positions and seeds get unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D1B54A33) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Position ``position``'s Gumbel noise over a vocabulary of ``vocab`` (CPU, float64)."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform.clamp_(min=1e-300)))


def nucleus(logits: torch.Tensor, params: SamplingParams, slack: float = 0.0) -> torch.Tensor:
    """The top-p nucleus of each row (a boolean mask): the most probable tokens whose mass before each is
    under top_p (under top_p + ``slack``, which may be negative; the most probable token always)."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = torch.argsort(probs, dim=-1, descending=True, stable=True)
    ranked = probs.gather(-1, order)
    before = torch.cumsum(ranked, dim=-1) - ranked
    inside = before < params.top_p + slack
    inside[..., 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, inside)


def _noisy(logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> torch.Tensor:
    """``logits + T * g`` for one row per position of ``positions`` (float64, CPU, no nucleus)."""
    assert params.seed is not None, "sampling needs a seed: call SamplingParams.seeded() first"
    noise = torch.stack([gumbel(params.seed, p, logits.shape[-1]) for p in positions])
    return logits + params.temperature * noise.reshape(logits.shape)


def scores(logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    """What position ``position`` takes the argmax of, in logit units (so a gap is a difference of
    logits): the logits when greedy; else ``logits + T * g`` over the nucleus, ``-inf`` outside it."""
    logits = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return logits
    noisy = _noisy(logits, params, [position])
    if params.top_p < 1:
        noisy = noisy.masked_fill(~nucleus(logits, params), -math.inf)
    return noisy


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at output position ``position`` given that position's logits (one row)."""
    return int(torch.argmax(scores(logits, params, position)))


def gaps(
    logits: torch.Tensor, params: SamplingParams, tokens: Sequence[int], nucleus_slack: float
) -> np.ndarray:
    """For each output position i (row i of ``logits``), how far ``tokens[i]`` was from being chosen, in
    logits: 0 when it is the choice, else the winner's score minus its own. The nucleus's edge is blurred
    by ``nucleus_slack`` of probability mass either way, since the provider's logits put it a little
    elsewhere: a claimed token that far beyond it is scored as if inside (one further out is infinitely
    far), and a token that close inside it never wins against the claim. All rows at once: one sort of
    the nucleus for the whole output."""
    logits = logits.detach().to("cpu", torch.float64)
    index = torch.tensor(list(tokens), dtype=torch.long)[:, None]
    if params.greedy:
        return (logits.max(dim=-1).values - logits.gather(-1, index)[:, 0]).numpy()
    raw = _noisy(logits, params, range(len(tokens)))
    if params.top_p >= 1:
        best = raw.max(dim=-1).values
        return (best - raw.gather(-1, index)[:, 0]).numpy()
    best = raw.masked_fill(~nucleus(logits, params, -nucleus_slack), -math.inf).max(dim=-1).values
    result = (best - raw.gather(-1, index)[:, 0]).clamp(min=0)
    outside = ~nucleus(logits, params, nucleus_slack).gather(-1, index)[:, 0]
    result[outside] = math.inf
    return result.numpy()
