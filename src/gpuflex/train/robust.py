"""Robust aggregation: screening of pseudo-gradients by their geometry, and clipped averaging.

Pure tensor arithmetic on flattened deltas, no I/O (``verifier.py`` adds the checks that need data):

- **norm screen**: a delta longer than ``norm_high`` × the median norm is a poison (scaled); one shorter
  than ``norm_low`` × the median × its claimed share of the round's learning rate did not train what it
  claims (a late honest worker claims fewer steps, so its bound shrinks with their share of the lr).
- **cosine screen**: each delta against the robust center of all (one ``robust_mean``: a single delta
  moves it by at most its clipping radius over n); honest workers on different shards still pull the
  same way (measured: cosine 0.2–0.6 with top-k), sign flips and noise do not. Not a delta whose
  residual chain is younger than the median (``fresh``: a replacement node's): its top-k picks other
  coordinates than the carried residuals of the others do, so its cosine says nothing (an honest joiner
  measured −0.014 in ``bench/verification.py``); the verifier's loss test judges it instead.
- **aggregation**: median-norm clipping (no delta longer than the median), then centered clipping
  (Karimireddy et al. 2021): from the clipped mean ``v``, ``v += mean_i clip(x_i − v, τ)`` with ``τ`` the
  median distance to ``v``, a few times. Each step is a convex combination of points in the ball of
  the median norm, so the result is never longer than the median input: a minority can bend it by at
  most ``τ`` each. Weights are the claimed tokens, capped at the median claim (claiming more buys no
  weight). Coordinate-wise medians are not used: top-k deltas barely share coordinates, and the median
  of mostly-zero coordinates is zero.

``naive_mean`` (the token-weighted mean, what the plain aggregator takes) is kept to report beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Delta = dict[str, Tensor]


@dataclass(frozen=True)
class Thresholds:
    norm_high: float = 3.0  # × the median norm
    norm_low: float = 0.5  # × the median norm × the claimed steps' share of the round's lr (honest: 0.9–1.1)
    cosine_min: float = 0.05  # to the robust center


THRESHOLDS = Thresholds()
CENTERED_ITERS = 3


def flatten(delta: Delta) -> Tensor:
    return torch.cat([delta[n].detach().flatten().float() for n in sorted(delta)])


def unflatten(flat: Tensor, like: Delta) -> Delta:
    out, at = {}, 0
    for name in sorted(like):
        n = like[name].numel()
        out[name] = flat[at : at + n].view_as(like[name]).to(like[name].dtype)
        at += n
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def clip(x: Tensor, tau: float) -> Tensor:
    norm = float(x.norm())
    return x if norm <= tau or norm == 0 else x * (tau / norm)


def naive_mean(flats: list[Tensor], weights: list[float]) -> Tensor:
    total = sum(weights)
    return sum(w * x for w, x in zip(weights, flats, strict=True)) / total


def robust_mean(flats: list[Tensor], weights: list[float], iters: int = CENTERED_ITERS) -> Tensor:
    """Median-norm clipping, then centered clipping around the clipped mean."""
    cap = median(weights)
    weights = [min(w, cap) for w in weights]
    tau = median([float(x.norm()) for x in flats])
    clipped = [clip(x, tau) for x in flats]
    v = naive_mean(clipped, weights)
    for _ in range(iters):
        radius = median([float((x - v).norm()) for x in clipped])
        v = v + naive_mean([clip(x - v, radius) for x in clipped], weights)
    return v


def cosine(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def fresh(chains: list[int]) -> list[bool]:
    """Which residual chains are younger than the median: joiners', whose cosine says nothing."""
    middle = median([float(c) for c in chains]) if chains else 0.0
    return [c < middle for c in chains]


def screen(
    flats: list[Tensor], shares: list[float], th: Thresholds = THRESHOLDS, chains: list[int] | None = None
) -> list[tuple[str, dict[str, float]] | None]:
    """For each delta, None or (why it is rejected, its numbers). ``shares``: the share of a full round's
    learning-rate sum its claimed steps take (``schedule.lr_share``). ``chains``: how many compressions
    each sender's error-feedback residual has been through; a delta's lower bound is the median norm of
    those whose chains are no longer (a younger residual has carried less), if there are three.

    Needs three deltas or more: with fewer, a median says nothing about who is odd."""
    if len(flats) < 3:
        return [None] * len(flats)
    norms = [float(x.norm()) for x in flats]
    med = median(norms)
    chains = chains or [0] * len(flats)
    center = robust_mean(flats, [1.0] * len(flats))
    young = fresh(chains)
    verdicts: list[tuple[str, dict[str, float]] | None] = []
    for i, x in enumerate(flats):
        numbers = {"norm": norms[i], "median_norm": med}
        if norms[i] > th.norm_high * med:
            verdicts.append((f"its norm is over {th.norm_high:g}× the median", numbers))
            continue
        peers = [n for n, chain in zip(norms, chains, strict=True) if chain <= chains[i]]
        if len(peers) >= 3 and norms[i] < th.norm_low * median(peers) * min(1.0, shares[i]):
            numbers["peers_median_norm"] = median(peers)
            verdicts.append(
                (f"its norm is under {th.norm_low:g}× the median for the steps it claims", numbers)
            )
            continue
        numbers["cosine"] = cos = cosine(x, center)
        low = cos < th.cosine_min and not young[i]
        verdicts.append((f"its cosine to the others is under {th.cosine_min:g}", numbers) if low else None)
    return verdicts


__all__ = [
    "THRESHOLDS",
    "Thresholds",
    "cosine",
    "flatten",
    "fresh",
    "naive_mean",
    "robust_mean",
    "screen",
    "unflatten",
]
