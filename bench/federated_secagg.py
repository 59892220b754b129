"""Secure aggregation's cost in the round protocol and its dropout recovery (issue 31's benchmark: the
secure-aggregation half; ``bench/federated.py`` measures the rest).

``measure(quick)`` returns:

- ``secagg_bytes_ratio``: bytes per round with secure aggregation ÷ without, the same job and compression
  (target ≤ 1.5). The job runs twice through ``train.local.run_local``: real worker and aggregator
  processes playing the round protocol's code over an in-process hub (not HTTP, not the coordinator), 4
  workers of equal weight, rounds of 60 inner steps (120 without ``--quick``), ``compression: none``
  (masked 32-bit fixed point), and again under int8 (``secagg_bytes_ratio_int8``: the owners quantize on
  a shared grid and mask in a 9-bit ring, bit-packed; ``train.secure``'s doc). Bytes are all that
  crossed the workers' links (``LinkStats``: contributions, updates, every poll and secure aggregation's
  keys, sealed shares, requests and reveals), over the rounds.
- ``secagg_time_overhead``: the share of a round's time secure aggregation holds the round up, in the
  secure run: the aggregator's seconds from a round's quorum to its unmasked sum (the unmask request,
  the reveals, the unmasking) plus the mean worker's seconds between its training's end and its masked
  upload (the shares it still waited for, the masking), over the rounds' seconds (target ≤ 0.10). The
  keys and shares are exchanged while the workers train, off that path. ``round_s_plain`` and
  ``round_s_secure`` compare the two runs' mean round times too, which a shared machine makes noisy.
- ``dropout_round_completed``: one round of 4 owners (``train.secure.rehearse``: the tasks' code, each
  owner on a thread, over a ``LocalTransport``), one owner gone after sharing its secrets and before its
  masked update: true iff the round's mean is the exact FedAvg of the other three (to the fixed point's
  step); ``dropout_round_completed_int8`` the same on the shared grid (to its steps).
- ``val_loss_int8_plain``, ``val_loss_int8_secure``: the two int8 runs' final validation loss: what the
  shared grid's coarser (per-tensor) quantization costs once error feedback has carried what it dropped.

Run: ``python bench/federated_secagg.py [--quick]``; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpuflex.privacy import secagg
from gpuflex.privacy.fixedpoint import FixedPoint, Layout, flatten
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.testing import small_job, write_corpus
from gpuflex.train.corpus import build_corpus
from gpuflex.train.local import LocalResult, run_local
from gpuflex.train.secure import NO_DP_RANGE, Roster, agreed_grid, first_ranges, rehearse

OWNERS = 4


def _run(corpus: bytes, rounds: int, steps: int, compression: str, secure: bool) -> LocalResult:
    with tempfile.TemporaryDirectory() as tmp:
        job = small_job(Path(tmp), workers=OWNERS, rounds=rounds, inner_steps=steps, compression=compression)
    spec = job.training
    threshold = secagg.job_threshold(OWNERS) if secure else None
    return run_local(spec, corpus, OWNERS, poll_interval_s=0.05, secure_aggregation=threshold, timeout_s=600)


def _bytes_per_round(result: LocalResult) -> float:
    return sum(w.link.bytes_total for w in result.workers) / len(result.rounds[1:])


def _round_seconds(result: LocalResult) -> float:
    times = [r.seconds for r in result.rounds]
    return statistics.mean(b - a for a, b in itertools.pairwise(times[1:]))


def _held_up(result: LocalResult) -> float:
    """The share of the rounds' time secure aggregation was on the round's critical path."""
    workers = statistics.mean(w.summary.secure_s for w in result.workers)
    return (result.aggregator.secure_s + workers) / (result.rounds[-1].seconds - result.rounds[0].seconds)


def dropout_round_completed(compression: str) -> bool:
    weights = {f"owner-{i}": 1000 * (i + 1) for i in range(OWNERS)}
    rng = np.random.default_rng(0)
    deltas = {t: {"w": torch.from_numpy(rng.normal(0, 0.01, (64, 32)))} for t in weights}
    gone = "owner-2"
    mean, _ = rehearse(deltas, weights, compression=compression, vanish_after_sharing=frozenset({gone}))
    others = [t for t in weights if t != gone]
    total = sum(weights[t] for t in others)
    expected = sum(weights[t] / total * flatten(deltas[t])[0] for t in others)
    if compression == "none":
        step = FixedPoint(NO_DP_RANGE, OWNERS).step
    else:  # the grid rehearse's round 0 agreed: ranges from the spec, 3 of 4 survivors' threshold
        layout = Layout(("w",), ((64, 32),), ("float64",))
        roster = Roster(0, tuple(weights), first_ranges(TrainingSpec(), layout, None))
        step = float(agreed_grid(127, roster, layout, weights, None, 3, None).step.max())
    return bool(
        np.max(np.abs(flatten(mean)[0] - expected)) <= len(others) * step * sum(weights.values()) / total
    )


def measure(quick: bool) -> dict:
    rounds, steps = (4, 60) if quick else (8, 120)  # rounds of seconds: DiLoCo's are long by design
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp) / "text")
        corpus = build_corpus(str(Path(tmp) / "text"), 200_000, [".txt"])
    began = time.monotonic()
    plain, secure = (_run(corpus, rounds, steps, "none", s) for s in (False, True))
    plain8, secure8 = (_run(corpus, rounds, steps, "int8", s) for s in (False, True))
    return {
        "owners": OWNERS,
        "rounds": rounds,
        "inner_steps": steps,
        "measured_through": "train.local.run_local: worker and aggregator processes over an in-process hub",
        "bytes_per_round_plain": round(_bytes_per_round(plain)),
        "bytes_per_round_secure": round(_bytes_per_round(secure)),
        "secagg_bytes_ratio": round(_bytes_per_round(secure) / _bytes_per_round(plain), 3),
        "bytes_per_round_int8_plain": round(_bytes_per_round(plain8)),
        "bytes_per_round_int8_secure": round(_bytes_per_round(secure8)),
        "secagg_bytes_ratio_int8": round(_bytes_per_round(secure8) / _bytes_per_round(plain8), 3),
        "val_loss_int8_plain": round(plain8.rounds[-1].val_loss, 4),
        "val_loss_int8_secure": round(secure8.rounds[-1].val_loss, 4),
        "round_s_plain": round(_round_seconds(plain), 3),
        "round_s_secure": round(_round_seconds(secure), 3),
        "secagg_time_overhead": round(_held_up(secure), 3),
        "dropout_round_completed": dropout_round_completed("none"),
        "dropout_round_completed_int8": dropout_round_completed("int8"),
        "wall_s": round(time.monotonic() - began, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of 60 steps instead of 8 of 120")
    print(json.dumps(measure(parser.parse_args().quick)))


if __name__ == "__main__":
    main()
