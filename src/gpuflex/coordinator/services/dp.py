"""A federated job's differential privacy on the coordinator: its ``privacy.dp`` resolved (at submit,
before the budget moves), the rounds it runs, the ε each published round spent, and what its tasks get.

The coordinator keeps the privacy ledger: ε after round k is the accountant's (RDP, q = 1, k rounds of
the Gaussian mechanism at the job's noise multiplier), stored with the round when it is published. A job
whose ``target_epsilon`` allows fewer rounds than ``training.rounds`` completes after the last round
within it, and its log says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpuflex.errors import SpecError
from gpuflex.market.pricing import trained_count
from gpuflex.privacy import dp
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

# the noise's norm over the clip from which submit warns: the momentum of the outer steps averages noise out
# over rounds, so some is harmless (3 owners of char-gpt trained at 1.8 and diverged from round 3 at 44)
NOISE_WARNING_RATIO = 10.0


def plan(spec: JobSpec) -> dp.DPPlan | None:
    """The job's DP plan (None without ``privacy.dp``); a SpecError names a setting that cannot be met."""
    if spec.privacy.dp is None:
        return None
    return dp.for_job(spec.privacy.dp, spec.training.rounds)


def last_round(spec: JobSpec) -> int:
    """The round whose publishing completes the job."""
    return dp.rounds_run(plan(spec), spec.training.rounds)


def epsilon(spec: JobSpec, round_: int) -> float | None:
    """ε spent once round ``round_`` is published (None: no DP, or no delta to account it for)."""
    p = plan(spec)
    accountant = p.accountant if p is not None else None
    return None if accountant is None else accountant.epsilon(round_)


def task(spec: JobSpec) -> m.DPTask | None:
    p = plan(spec)
    if p is None:
        return None
    return m.DPTask(clip=p.clip, noise_multiplier=p.noise_multiplier, rounds=last_round(spec))


def status(spec: JobSpec, published: int) -> m.DPStatus | None:
    p = plan(spec)
    if p is None:
        return None
    return m.DPStatus(
        clip=p.clip,
        noise_multiplier=p.noise_multiplier,
        delta=p.delta,
        target_epsilon=p.target_epsilon,
        epsilon=epsilon(spec, max(published, 0)),
        rounds=last_round(spec),
    )


def submitted(spec: JobSpec) -> str | None:
    """The job's first log line about its privacy (None without DP); refuses what cannot be met."""
    p = plan(spec)
    if p is None:
        return None
    given = spec.privacy.dp.noise_multiplier is not None
    line = (
        f"privacy.dp: clip {p.clip:g}, noise multiplier {p.noise_multiplier:.4g}"
        f"{'' if given else ' (the least keeping every round within the target)'}"
    )
    if p.accountant is None:
        return line + "; no delta: ε is not accounted"
    rounds = last_round(spec)
    spent = p.accountant.epsilon(rounds)
    if not spent <= dp.MAX_EPSILON:  # inf too: a noise multiplier so small the accountant gives up
        raise SpecError(
            f"privacy.dp: noise multiplier {p.noise_multiplier:g} over {rounds} rounds spends ε={spent:.3g}, "
            f"past {dp.MAX_EPSILON:g}, where the guarantee says nothing: raise noise_multiplier, or leave "
            "delta out to clip and noise without accounting"
        )
    line += f", δ {p.delta:g}: ε {spent:.3g} after {rounds} rounds"
    if p.target_epsilon is not None:
        line += f" (target {p.target_epsilon:g})"
    if rounds < spec.training.rounds:
        line += (
            f"; the target allows {rounds} of the {spec.training.rounds} rounds asked: "
            f"the job stops after round {rounds}"
        )
    return line


def noise_warning(spec: JobSpec, weights: Sequence[int]) -> str | None:
    """For a federated job whose owners weigh ``weights`` (tokens), a line for the job's log and its
    submitter when the noise on each round's average outweighs the average itself by
    ``NOISE_WARNING_RATIO`` or more (None when not, or the model's size is unknown). The clip bounds the
    average's norm; the noise's norm grows with the square root of the parameters and shrinks only with
    more owners, so client-level DP among a handful of owners drowns the update, and the model learns
    little or diverges: better said before the budget is spent than found in the losses."""
    p, parameters = plan(spec), trained_count(spec.training)
    if p is None or parameters is None:
        return None
    std = dp.mean_noise_std(p.clip, p.noise_multiplier, [float(w) for w in weights])
    ratio = std * math.sqrt(parameters) / p.clip
    if ratio < NOISE_WARNING_RATIO:
        return None
    return (
        f"privacy.dp: warning: each round's average gets noise of std {std:.3g} on each of its "
        f"{parameters:,} parameters, a norm about {ratio:.0f} times the clip {p.clip:g} that bounds the "
        f"average itself: with {len(weights)} owners the model may learn little or diverge (the noise "
        "shrinks with the owners' count; client-level DP is made for many owners)"
    )


def stopped(spec: JobSpec, round_: int) -> str | None:
    """The log line of a job its target ε stopped at ``round_`` (None if it ran every round it asked)."""
    p = plan(spec)
    if p is None or p.accountant is None or round_ >= spec.training.rounds:
        return None
    spent, next_ = p.accountant.epsilon(round_), p.accountant.epsilon(round_ + 1)
    return (
        f"privacy.dp: stopped after round {round_} of {spec.training.rounds}: ε {spent:.3g} spent, and "
        f"round {round_ + 1} would spend ε {next_:.3g}, "
        f"over the target {p.target_epsilon:g}"
    )
