"""Verification benchmark: honest workers and every adversary kind, screened, audited and aggregated.

    .venv/bin/python bench/verification.py --quick    # < 5 min on 2 cores
    .venv/bin/python bench/verification.py            # >= 300 honest and >= 300 adversarial contributions

It runs jobs as ``gpuflex.train.drill.Drill``: a direct loop over the runtime's own pieces (traced
deterministic training, ``adversaries``, the workers' compressors with error feedback, the ``Verifier``'s
screening and audits, ``robust_mean``), without threads or polling. The adversaries see the honest
deltas (they collude, the strongest case), every contribution is judged (nobody is excluded, so each
counts), and the audit draw is uniform with ``audit_rate`` as the coordinator's.

Honest workers include a late one (half the steps, claimed as such) and run on heterogeneous shards
(the standard library's source, one contiguous shard each) with compressed updates. From round 1 on,
one honest worker a round is replaced by a fresh node (fresh optimizer moments and an empty
error-feedback residual, as a task re-leased after a crash): its delta is shorter than the others', whose
residuals have carried mass for rounds (``joiner_contributions`` counts them). Two more honest
jobs run on the integration tests' word-salad text: one long past its loss plateau (60 rounds), where a
noisy screen would convict honest workers, and one with time-budgeted rounds, every contribution
audited, whose warm-up ends inside a round; their contributions count in the false positives (not in
the extra compute: their short rounds are no measure of it). A second pair of
jobs trains with 20% ALIE workers and without adversaries, and compares their final validation loss; they
run at the default audit rate (0.05), so most ALIE contributions go unaudited and only the clipping
bounds them (audited, ALIE is convicted: the audit binds the delta to the trace).

Last stdout line (JSON): detection_rate (overall and per kind, with Clopper-Pearson 95% bounds),
false_positive_rate (with bounds), extra_compute (verification seconds / training seconds, measured at
``--audit-rate``: the workers' tracing — hashing and copying their states for the commitment, which is
``tracing_share`` of training — plus the verifier's screening and audits), extra_compute_at_default_rate
(tracing and screening as measured, the audits' seconds scaled to the default rate 0.05),
extra_compute_long_rounds, tracing_share_long_rounds and audit_share_long_rounds (an honest job of
512-step rounds of 2,048-token batches, traced into 64 segments, every contribution audited: verification's
costs beside rounds of DiLoCo's length; its contributions count in the false positives),
commitment_bytes_per_round (the largest commitment's JSON), rounds_to_detect (median over adversary
workers caught: rounds from its first cheating contribution to its first conviction, 1 = at once),
workers_never_caught (per kind: cheating workers convicted in none of their rounds), peer_audits (jobs
whose drawn contributions a second provider re-runs, ``PEER_SEGMENTS`` segments from the drawn one, with
the core node re-running only a dispute's first divergent segment: detection per kind, false positives,
the core node's audit seconds beside the same share without peers, and the peers' seconds, over
training; their honest contributions count in the false positives too).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpuflex.protocol.messages import Commitment
from gpuflex.protocol.spec import ModelSpec, TrainingSpec, VerificationSpec
from gpuflex.testing import small_job, write_corpus
from gpuflex.train import adversaries
from gpuflex.train.corpus import build_corpus
from gpuflex.train.drill import LATE, Drill

DEFAULT_RATE = VerificationSpec().audit_rate  # what a job audits unless it says otherwise (0.05)
SEGMENTS = 32  # trace hashes per round: an audit re-runs 1/32 of a round; 32 hashes keep a commitment < 1 KB
SMALL = ModelSpec(n_layer=1, n_head=2, n_embd=32, block_size=32)  # with batches of 8: 256 tokens a step
# The long-round job: rounds as long as DiLoCo's (H = 500), a model and batches less tiny (2,048 tokens a
# step), and the most trace hashes a commitment holds (64, still < 1 KB): an audit re-runs 8 steps of 512.
LONG_ROUND = 512
LONG_SEGMENTS = 64
LONG_MODEL = ModelSpec(n_layer=2, n_head=2, n_embd=64, block_size=64)
LONG_BATCH = 32
# Peer audits: a second provider re-runs a quarter of a round from each drawn segment; the kinds they
# are measured against: the one-segment shirker a single re-run segment rarely sees, two that cheat on
# every step, and a peer that reports its re-runs of others' segments falsely
PEER_SEGMENTS = 8
PEER_KINDS = ["skip-segment", "skip-segment", "few-steps", "bf16", "framer"]


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta I_x(a, b), by its continued fraction (Numerical Recipes 6.4)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x > (a + 1) / (a + b + 2):
        return 1.0 - beta_cdf(1 - x, b, a)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return front * f / a


def beta_quantile(q: float, a: float, b: float) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if beta_cdf(mid, a, b) < q else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int) -> list[float]:
    """The exact 95% interval of a binomial proportion k/n."""
    if n == 0:
        return [0.0, 1.0]
    low = 0.0 if k == 0 else beta_quantile(0.025, k, n - k + 1)
    high = 1.0 if k == n else beta_quantile(0.975, k + 1, n - k)
    return [round(low, 4), round(high, 4)]


@dataclass
class Tally:
    honest: int = 0
    joiners: int = 0  # honest contributions of a worker in the round it was replaced (an empty residual)
    false_positives: int = 0
    caught: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    rounds_to_detect: list[int] = field(default_factory=list)
    never_caught: dict[str, int] = field(default_factory=dict)  # kind -> cheating workers never convicted
    train_s: float = 0.0  # the workers' training, their tracing left out
    trace_s: float = 0.0  # the workers' tracing: hashing and copying states for their commitments
    verify_s: float = 0.0  # the verifier's: screening and audits
    audit_s: float = 0.0  # the audits' part of verify_s
    peer_s: float = 0.0  # with peer audits: the peers' re-runs

    def extra(self, audit_scale: float = 1.0) -> float:
        """Verification compute (the workers' tracing, the verifier's screening, the audits' seconds
        times ``audit_scale``) over training compute."""
        return (self.trace_s + self.verify_s - self.audit_s * (1 - audit_scale)) / self.train_s

    commitment_bytes: int = 0
    checks: dict[str, int] = field(default_factory=dict)


def spec_for(
    args: argparse.Namespace,
    rounds: int,
    audit_rate: float | None = None,
    robust: bool = True,
    *,
    model: ModelSpec = SMALL,
    batch_size: int = 8,
    segments: int = SEGMENTS,
    peer_segments: int = 0,
) -> TrainingSpec:
    return TrainingSpec(
        rounds=rounds,
        inner_steps=args.inner_steps,
        batch_size=batch_size,
        lr=3e-3,
        eval_batches=4,
        model=model,
        compression={"method": "topk", "density": 0.1, "values": "int8"},
        verification={
            "audit_rate": args.audit_rate if audit_rate is None else audit_rate,
            "trace_every": max(1, args.inner_steps // segments),
            "robust": robust,
            "peer_segments": peer_segments,
        },
        round_timeout_s=60,
    )


def run_job(
    kinds: list[str | None],
    spec: TrainingSpec,
    corpus: bytes,
    tally: Tally | None,
    seed: int,
    joiners: bool = False,
) -> float:
    """One job with a worker per entry of ``kinds`` (None: honest); returns its final validation loss.
    ``joiners``: from round 1 on, one honest worker a round is replaced by a fresh node."""
    drill = Drill(spec, corpus, kinds)
    honest = [i for i, kind in enumerate(kinds) if kind in (None, LATE)]
    rng = random.Random(seed)

    def draw(worker: int, commitment: Commitment) -> int | None:
        return rng.randrange(len(commitment.trace)) if rng.random() < spec.verification.audit_rate else None

    first_cheat: dict[int, int] = {}  # worker -> the first round it cheated
    detected: dict[int, int] = {}  # worker -> rounds from its first cheat to its first conviction
    for r in range(spec.rounds):
        if joiners and r and honest:
            drill.restart(honest[(r - 1) % len(honest)])
            if tally is not None:
                tally.joiners += 1
        before, audits_before, peers_before = drill.verifier.compute_s, drill.verifier.audit_s, drill.peer_s
        judged, results = drill.round(r, draw)
        if tally is not None:
            tally.verify_s += drill.verifier.compute_s - before
            tally.audit_s += drill.verifier.audit_s - audits_before
            tally.peer_s += drill.peer_s - peers_before
            tally.trace_s += sum(res.trace_s for res in results.values())
            tally.train_s += sum(res.compute_s - res.trace_s for res in results.values())
            sizes = [len(res.commitment.model_dump_json()) for res in results.values() if res.commitment]
            tally.commitment_bytes = max(tally.commitment_bytes, *sizes)
            _count(tally, kinds, judged, r, first_cheat, detected)
    if tally is not None:
        tally.rounds_to_detect += detected.values()
        for worker in first_cheat.keys() - detected.keys():
            kind = str(kinds[worker])
            tally.never_caught[kind] = tally.never_caught.get(kind, 0) + 1
    return drill.validation_loss() or float("nan")


def _cheats(kind: str | None, round: int) -> bool:
    """Whether a worker of ``kind`` cheats in ``round`` (the jump and the stale/fake-trace start honest)."""
    if kind in (None, LATE):
        return False
    if kind == "jump":
        return round >= adversaries.JUMP_AFTER
    if kind in ("stale", "fake-trace"):
        return round >= 1
    return True


def _count(
    tally: Tally, kinds: list[str | None], judged: list, round: int, first_cheat: dict, detected: dict
) -> None:
    for i, j in enumerate(judged):
        kind = kinds[i]
        if j.guilty:
            tally.checks[j.verdict.check] = tally.checks.get(j.verdict.check, 0) + 1
        if not _cheats(kind, round):
            if kind in (None, LATE):
                tally.honest += 1
                tally.false_positives += j.guilty
            continue
        tally.total[kind] = tally.total.get(kind, 0) + 1
        tally.caught[kind] = tally.caught.get(kind, 0) + j.guilty
        first_cheat.setdefault(i, round)
        if j.guilty and i not in detected:
            detected[i] = round - first_cheat[i] + 1


def word_salad_jobs(plateau_rounds: int) -> Tally:
    """Honest jobs on the integration tests' word-salad text, where early screens convicted honest workers.

    One runs long past its loss plateau (8-step rounds): one batch's loss gain is noise there (a screen
    convicted 5 of 120 such contributions). One has time-budgeted rounds, as the chaos tests' jobs, all
    audited: warm-up ends inside its round 0, whose steps' learning rates rise above those at both of the
    round's ends (an audit that checked them against the ends convicted honest workers).
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_corpus(data)
        corpus = b"".join(p.read_bytes() for p in sorted(data.iterdir()))
        plateau = small_job(data, workers=4, rounds=plateau_rounds, inner_steps=8, batch_size=8).training
        budgeted = small_job(data, workers=3, rounds=8, inner_steps=1000, round_seconds=0.5).training
    audit_all = budgeted.verification.model_copy(update={"audit_rate": 1.0})
    tally = Tally()  # counted apart: these short rounds say nothing of the extra compute of real ones
    run_job([None, None, None, LATE], plateau, corpus, tally, seed=0)
    run_job([None] * 3, budgeted.model_copy(update={"verification": audit_all}), corpus, tally, seed=0)
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--inner-steps", type=int, default=64)
    parser.add_argument("--audit-rate", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = list(adversaries.TRAINING_KINDS)
    rounds = 3 if args.quick else 8
    corpus = build_corpus("stdlib", 400_000, [".py"])
    tally = Tally()
    began = time.monotonic()
    jobs = 1 if args.quick else 5
    for job in range(jobs):
        # every kind once per job, beside as many honest workers (one of them late)
        for group in (kinds[:7], kinds[7:]):
            honest: list[str | None] = [None] * (len(group) - 1) + [LATE]
            run_job([*honest, *group], spec_for(args, rounds), corpus, tally, seed=job, joiners=True)
    salad = word_salad_jobs(60 if not args.quick else 30)
    # rounds as long as DiLoCo's: the tracing's and screening's costs, which grow with the model's state
    # and the round's batch count, shrink beside training, which grows with the tokens a step trains on
    long = Tally()
    long_args = argparse.Namespace(**{**vars(args), "inner_steps": LONG_ROUND})
    long_spec = spec_for(
        long_args, 1 if args.quick else 2, model=LONG_MODEL, batch_size=LONG_BATCH, segments=LONG_SEGMENTS
    )
    # --quick: two workers (one late): this job alone took 161 s of a quick run with four
    run_job([None] * (1 if args.quick else 3) + [LATE], long_spec, corpus, long, seed=0)
    # peer audits: another worker re-runs PEER_SEGMENTS segments from each drawn one, the core node
    # re-runs only the first segment of a dispute
    peer = Tally()
    peer_kinds: list[str | None] = [None, None, None, LATE, *PEER_KINDS]
    for job in range(jobs):
        spec = spec_for(args, rounds, peer_segments=PEER_SEGMENTS)
        run_job(peer_kinds, spec, corpus, peer, seed=job, joiners=True)
    for honest_only in (salad, long, peer):
        tally.honest += honest_only.honest
        tally.false_positives += honest_only.false_positives
    # at the job's default audit rate: most ALIE rounds go unaudited, and only the clipping bounds them
    alie_spec = spec_for(args, 4 if args.quick else 12, audit_rate=DEFAULT_RATE)
    clean = run_job([None] * 10, alie_spec, corpus, None, seed=0)
    with_alie = run_job([None] * 8 + ["alie"] * 2, alie_spec, corpus, None, seed=0)
    # the same attack against the plain token-weighted mean (no screening, no clipping), for comparison
    naive_spec = spec_for(args, alie_spec.rounds, audit_rate=0.0, robust=False)
    naive_alie = run_job([None] * 8 + ["alie"] * 2, naive_spec, corpus, None, seed=0)
    caught, total = sum(tally.caught.values()), sum(tally.total.values())
    result = {
        "detection_rate": {
            "overall": round(caught / total, 4),
            "overall_ci95": clopper_pearson(caught, total),
            "contributions": total,
            **{k: round(tally.caught[k] / tally.total[k], 4) for k in kinds if tally.total.get(k)},
        },
        "false_positive_rate": tally.false_positives / max(tally.honest, 1),
        "false_positive_ci95": clopper_pearson(tally.false_positives, tally.honest),
        "honest_contributions": tally.honest,
        "honest_on_word_salad": salad.honest,  # past the plateau, and in time-budgeted rounds
        "joiner_contributions": tally.joiners,  # honest, in the round a fresh node took the task over
        "extra_compute": round(tally.extra(), 4),
        "tracing_share": round(tally.trace_s / tally.train_s, 4),  # of extra_compute: the workers' part
        "audit_rate": args.audit_rate,
        "extra_compute_at_default_rate": round(tally.extra(DEFAULT_RATE / max(args.audit_rate, 1e-9)), 4),
        "extra_compute_long_rounds": round(long.extra(), 4),  # H = 512, 2,048 tokens a step, all audited
        "tracing_share_long_rounds": round(long.trace_s / long.train_s, 4),
        "audit_share_long_rounds": round(long.audit_s / long.train_s, 4),
        "commitment_bytes_per_round": max(tally.commitment_bytes, long.commitment_bytes),
        "rounds_to_detect": statistics.median(tally.rounds_to_detect) if tally.rounds_to_detect else None,
        "workers_never_caught": tally.never_caught,  # cheating workers not convicted in any of their rounds
        "convictions_by_check": tally.checks,
        "peer_audits": {
            "peer_segments": PEER_SEGMENTS,
            "detection_rate": {k: round(peer.caught[k] / peer.total[k], 4) for k in PEER_KINDS},
            "contributions": sum(peer.total.values()),
            "honest_contributions": peer.honest,
            "false_positives": peer.false_positives,
            "core_audit_share": round(peer.audit_s / peer.train_s, 4),  # checks, and re-runs of disputes
            "core_audit_share_without_peers": round(tally.audit_s / tally.train_s, 4),
            "peer_share": round(peer.peer_s / peer.train_s, 4),
            "convictions_by_check": peer.checks,
        },
        "alie_20pct_val_loss": round(with_alie, 4),  # at the default audit rate
        "clean_val_loss": round(clean, 4),
        "alie_loss_gap": round(with_alie / clean - 1, 4),
        "alie_20pct_naive_mean_val_loss": round(naive_alie, 4),
        "alie_naive_mean_loss_gap": round(naive_alie / clean - 1, 4),
        "seconds": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
