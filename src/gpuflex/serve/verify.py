"""Whether a provider served what it was asked: one prefill of prompt + output on the verifier's model.

The prefill gives, at each output position, the last layer's hidden state and the logits the provider
should have computed while decoding. Two checks, and a ``Finding`` like the training verifier's:

- **fingerprints** (``fingerprint.compare``): per 32-token chunk, the share of the verifier's top-k
  indices whose values the proof reproduces, and on those the exponent mismatches and the mantissa
  differences. A different model (layers dropped, weights quantized) or a different prompt (a dropped
  system message) moves the hidden states, so the values (or even the indices) stop agreeing; copied
  fingerprints belong to other hidden states altogether.
- **sampling** (``sampling.gaps``): each claimed token is replayed with the request's seed and its
  position's noise; a token the verifier would not have drawn is a mismatch, tolerated only where the
  two scores are within ``tie`` logits (a near tie that numerical noise may flip) and only on a small
  share of positions. This catches another temperature and tokens the model did not produce, which a
  provider can fingerprint honestly by a prefill of its own.

Both sides compute in the deployment's dtype, judged by that dtype's ``Thresholds.for_dtype``. The
default ``Thresholds`` hold for float32: honest runs agree to a few bf16 ulps across thread counts, batch
sizes and padding, where the cheats of ``cheats`` are far off (tests/serve/test_verify.py measures both
sides). bf16's are wider and grow with the model's depth, measured on a CPU (``bench/inference_dtype.py``),
not yet on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuflex.serve.fingerprint import CHUNK, ChunkComparison, compare, proofs_for
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams, gaps


@dataclass(frozen=True)
class Thresholds:
    """What an honest output stays within; the defaults are float32's (``for_dtype``)."""

    min_common: float = 0.9  # every chunk: at least this share of the verifier's top-k is in the proof
    max_exponent_mismatch: float = 0.01  # of the shared values, at most this share differ in sign or exponent
    max_mantissa_mean: float = 0.25  # mean |mantissa difference| (bf16 ulps) over the shared values
    max_mantissa: int = 8  # and the largest
    min_mantissa_tokens: int = 1  # a shorter output is not judged by its mantissas
    tie: float = 1e-3  # a replayed draw that differs by at most this many logits is a near tie
    max_tie_share: float = 0.05  # near ties tolerated, as a share of the output's positions
    nucleus_slack: float = 1e-3  # probability mass by which the top-p nucleus's edge may lie either way

    @classmethod
    def for_dtype(cls, dtype: str, layers: int) -> Thresholds:
        """The thresholds for a model of ``layers`` layers that both sides compute in ``dtype``. In bf16
        each layer rounds its output, and a decode step (a token against the cache) rounds otherwise than
        the verifier's prefill, so honest figures spread, the more the deeper: the limits grow as the
        square root of the depth. fp16 (CUDA only) is judged by bf16's, which its finer rounding stays
        well within.

        Measured on one CPU (AMD EPYC, avx512_bf16) by ``bench/inference_dtype.py``, with random llamas 256
        wide (``init_std`` 0.1) of 4 layers (384 honest outputs, 24 per cheat) and 32 (96, 6), and the serve
        tests' shape, 64 wide and 2 layers (384, 24): honest outputs served on 1 and 2 threads in batches of
        1, 4 and 8 (left-padded), verified on 1 and 2. Honest, 8 tokens or more: mantissa difference at most
        0.58 sqrt(layers) ulps on average (over every run: 1.10 at 4 layers, 3.27 at 32; a sweep of 2 to 32
        layers agreed), 19 at most; exponents mismatched on at most 0.032 sqrt(layers) of the shared values;
        at least 90% of the top values shared; draws flipped at up to 5.5% of positions, all within 0.068
        sqrt(layers) logits; the nucleus's edge moved by under 0.005 of probability mass at 4 layers.
        Shorter outputs reach into smaller values, whose ulps the noise moves more (at one token up to 3.5
        ulps at 64 wide, where int8 weights show 3.0): their mantissas are not judged. int8 weights: at
        least 1.08 sqrt(layers) ulps on average at 256 wide (over every run: 2.56 at 4 layers, 6.10 at 32),
        0.86 sqrt(layers) at 64 wide; int4 weights, another prompt, another output or copied fingerprints
        share under 60% of the top values, and a layer dropped under 77% (its mantissas 7.8 ulps off at 4
        layers). Temperature cheats are caught but for short outputs and those equal to the honest one. fp16
        on CPU kernels, 4 layers: honest at most 0.15 ulps on average, int8 2.76. Not yet measured on GPUs,
        nor on trained models."""
        if dtype not in ("bf16", "fp16"):
            return cls()
        root = math.sqrt(layers)
        return cls(
            min_common=0.75,
            max_exponent_mismatch=0.05 * root,
            max_mantissa_mean=0.8 * root,
            max_mantissa=round(16 * root),
            min_mantissa_tokens=8,
            tie=0.1 * root,
            max_tie_share=1.0,  # bf16 logits flip near ties anywhere: one in a one-token output is all of it
            nucleus_slack=0.005 * root,
        )


@dataclass(frozen=True)
class Finding:
    ok: bool
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


def verify(
    model: ServedModel,
    prompt: list[int],
    tokens: list[int],
    params: SamplingParams,
    fingerprints: tuple[bytes, ...] | list[bytes],
    thresholds: Thresholds | None = None,
) -> Finding:
    """Check an output (``tokens``, sampled with ``params`` including its seed) of ``prompt``; by the
    thresholds of the dtype ``model`` computes in unless given others."""
    thresholds = thresholds or Thresholds.for_dtype(model.dtype, model.model.config.num_hidden_layers)
    if not tokens:
        return Finding(False, "the output is empty")
    if params.seed is None and not params.greedy:
        return Finding(False, "a sampled output must report its seed")
    if len(fingerprints) != proofs_for(len(tokens)):
        return Finding(
            False,
            f"{len(tokens)} tokens need {proofs_for(len(tokens))} fingerprints, not {len(fingerprints)}",
        )
    if len(prompt) + len(tokens) > model.context:
        return Finding(False, f"prompt and output overrun the model's context of {model.context} tokens")
    hidden, logits = model.prefill(list(prompt) + list(tokens))
    at = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))  # output position i's hidden state and logits
    hidden, logits = hidden[at], logits[at]
    try:
        chunks = [compare(proof, hidden[c * CHUNK : (c + 1) * CHUNK]) for c, proof in enumerate(fingerprints)]
    except ValueError as err:
        return Finding(False, f"a fingerprint is malformed: {err}")
    numbers = _fingerprint_numbers(chunks) | _sampling_numbers(logits, tokens, params, thresholds)
    return Finding(*_judge(numbers, thresholds), numbers)


def _fingerprint_numbers(chunks: list[ChunkComparison]) -> dict[str, float]:
    common = sum(c.common for c in chunks)
    diffs = np.array([d for c in chunks for d in c.mantissa_diffs], dtype=np.float64)
    return {
        "common_min": min(c.common / c.k for c in chunks),
        "exponent_mismatch": sum(c.exponent_mismatches for c in chunks) / common if common else 1.0,
        "mantissa_mean": float(diffs.mean()) if len(diffs) else float("inf"),
        "mantissa_max": float(diffs.max()) if len(diffs) else float("inf"),
    }


def _sampling_numbers(
    logits: torch.Tensor, tokens: list[int], params: SamplingParams, thresholds: Thresholds
) -> dict[str, float]:
    off = gaps(logits, params, tokens, thresholds.nucleus_slack)
    return {
        "positions": float(len(tokens)),
        "mismatches": float((off > 0).sum()),
        "far_mismatches": float((off > thresholds.tie).sum()),
        "gap_max": float(off.max()),
    }


def _judge(n: dict[str, float], t: Thresholds) -> tuple[bool, str]:
    """The first check that fails, in words; or that all passed."""
    if n["common_min"] < t.min_common:
        return (
            False,
            f"a chunk's fingerprint shares {n['common_min']:.0%} of its top values, under {t.min_common:.0%}",
        )
    if n["exponent_mismatch"] > t.max_exponent_mismatch:
        return False, f"{n['exponent_mismatch']:.1%} of the shared values differ in exponent"
    judged = n["positions"] >= t.min_mantissa_tokens
    if judged and (n["mantissa_mean"] > t.max_mantissa_mean or n["mantissa_max"] > t.max_mantissa):
        return False, (
            f"the hidden states differ by {n['mantissa_mean']:.2f} bf16 ulps on average, "
            f"{n['mantissa_max']:.0f} at most (limits {t.max_mantissa_mean}, {t.max_mantissa})"
        )
    if n["far_mismatches"]:
        return False, (
            f"{n['far_mismatches']:.0f} of {n['positions']:.0f} tokens are not what the seed draws "
            f"(up to {n['gap_max']:.3g} logits off)"
        )
    if n["mismatches"] > t.max_tie_share * n["positions"]:
        return False, f"{n['mismatches']:.0f} of {n['positions']:.0f} tokens are near ties the other way"
    return True, "the fingerprints and the sampling agree"
