"""Cheating workers, for tests, the verification benchmark and ``gpuflex demo --cheater``.

A task whose ``TaskConfig.adversary`` names one of ``KINDS`` plays it: each round the worker hands the
adversary a ``worker.Situation`` (the replica, the round's start, and — when the benchmark lets them
collude — the honest workers' deltas of the round) and submits whatever ``play`` returns: a delta,
the steps it claims and a commitment. A cheater still commits to a trace, so it either trained what it
claims (sending anything else is caught by an audit: the commitment binds the delta to the trace's
last state and the residual, ``audit.py``) or its trace is made up (an audit catches that too):

    lazy        zeros        submits nothing learned; a made-up trace
                noise        random noise at an honest delta's size; a made-up trace
                stale        replays its first round's contribution, commitment and all
    free-rider  free-rider   copies a peer's delta (or, alone, the last aggregate step); a made-up trace
    poisoner    scaled       its honest delta times 10
                sign-flip    its honest delta negated
                alie         mean − z·std of the honest deltas: inside their spread (Baruch et al. 2019)
                forged-residual  sends ALIE (alone: its delta negated) bound to its honest trace by a
                             residual forged to make compression yield it (the residual chain catches it)
    shirker     few-steps    trains a quarter of the steps, claims them all (pads its trace)
                other-data   trains on batches other than its assigned ones, commits to the assigned ones
                bf16         trains in bfloat16 autocast, claims full precision
                skip-segment takes one step of one trace segment a round, claims them all: 1/S of the work
                             saved, the rest honest, so only an audit of that segment can see it
    adaptive    adaptive     knows the norm screen: a quarter of the steps, rescaled to an honest norm
                jump         honest for two rounds (builds reputation), then a scaled sign-flip
                fake-trace   after one honest round, resubmits that delta under a fresh made-up trace
    false accuser  framer    trains honestly; as another worker's peer (``peer_audit.py``) reports a
                             hash it did not compute, accusing that worker
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import Commitment
from gpuflex.train.commitment import (
    TRACE_HEX,
    RoundTrace,
    batch_bytes,
    params_hash,
    trace_every,
)
from gpuflex.train.data import round_seed
from gpuflex.train.worker import Params, RoundResult, Situation

SCALE = 10.0  # the scaled poisoner's factor
ALIE_Z = 1.0  # how many standard deviations ALIE moves against the mean
SHIRK = 4  # few-steps and adaptive train 1/SHIRK of the steps
JUMP_AFTER = 2  # honest rounds before the jump


class Adversary(Protocol):
    def play(self, s: Situation) -> RoundResult | None: ...


def _norm(delta: Params) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


def _scaled(delta: Params, factor: float) -> Params:
    return {n: t * factor for n, t in delta.items()}


def _honest_norm(s: Situation) -> float:
    """An honest delta's size: the peers' median, else lr per coordinate per step (AdamW's step size)."""
    if s.peers:
        return sorted(_norm(p) for p in s.peers)[len(s.peers) // 2]
    numel = sum(t.numel() for t in s.start.values())
    return s.replica.spec.lr * math.sqrt(numel * s.replica.spec.inner_steps)


def made_up(s: Situation, steps: int, trace: list[str] | None = None) -> tuple[Commitment, RoundTrace]:
    """A commitment that names the assigned start, seed and batches, over a ``trace`` (random by default),
    and the only states such a cheater can upload when audited: the round's start, for every segment."""
    spec, worker = s.replica.spec, s.replica.worker_index
    seed = round_seed(spec.seed, worker, s.label)
    generator = torch.Generator().manual_seed(seed)
    data = hashlib.sha256()
    for _ in range(steps):
        data.update(batch_bytes(s.replica.data.sample(generator)))
    every = trace_every(spec)
    fake = random.Random(f"{seed}/made-up")
    length = -(-steps // every)
    trace = (trace or [])[:length]
    trace += [f"{fake.getrandbits(64):0{TRACE_HEX}x}" for _ in range(length - len(trace))]
    commitment = Commitment(
        seed=seed,
        start=params_hash(s.start),
        data=data.hexdigest(),
        every=every,
        trace=trace,
        device=s.replica.device_class(),
    )
    state = {f"p.{n}": t for n, t in s.start.items()}
    return commitment, RoundTrace(
        every, tuple([] for _ in range(length)), dict.fromkeys(range(length + 1), state)
    )


def _fake(s: Situation, delta: Params) -> RoundResult:
    steps = s.replica.spec.inner_steps
    commitment, trace = made_up(s, steps)
    return RoundResult(delta, steps, 0.0, 0.0, commitment, trace)


@dataclass
class Zeros:
    def play(self, s: Situation) -> RoundResult | None:
        return _fake(s, {n: torch.zeros_like(t) for n, t in s.start.items()})


@dataclass
class Noise:
    def play(self, s: Situation) -> RoundResult | None:
        generator = torch.Generator().manual_seed(s.label)
        noise = {n: torch.randn(t.shape, generator=generator) for n, t in s.start.items()}
        return _fake(s, _scaled(noise, _honest_norm(s) / _norm(noise)))


@dataclass
class Stale:
    first: RoundResult | None = None

    def play(self, s: Situation) -> RoundResult | None:
        if self.first is None:
            self.first = s.train()
            return self.first
        return self.first


@dataclass
class FreeRider:
    previous: Params | None = None  # the last round's start: start − previous is the last aggregate step

    def play(self, s: Situation) -> RoundResult | None:
        if s.peers:
            delta = {n: t.clone() for n, t in s.peers[0].items()}
        elif self.previous is not None:
            delta = {n: self.previous[n] - t for n, t in s.start.items()}
        else:
            delta = {n: torch.zeros_like(t) for n, t in s.start.items()}
        self.previous = {n: t.clone() for n, t in s.start.items()}  # the replica's own tensors move on
        return _fake(s, delta)


@dataclass
class Transform:
    """Trains honestly, commits honestly, and submits ``change(delta)``."""

    change: Callable[[Params, Situation], Params]

    def play(self, s: Situation) -> RoundResult | None:
        honest = s.train()
        return None if honest is None else replace(honest, delta=self.change(honest.delta, s))


def _alie(delta: Params, s: Situation) -> Params:
    if len(s.peers) < 2:
        return delta  # alone it has no spread to hide in
    out = {}
    for name in delta:
        stacked = torch.stack([p[name] for p in s.peers])
        out[name] = stacked.mean(0) - ALIE_Z * stacked.std(0)
    return out


@dataclass
class ForgedResidual:
    """Trains and commits honestly, then forges the residual its delta is compressed with, so that
    ``compress(delta + decay·residual)`` gives the poison: the audit's binding holds, the chain does not."""

    def play(self, s: Situation) -> RoundResult | None:
        honest = s.train()
        if honest is None:
            return None
        poison = _alie(honest.delta, s) if len(s.peers) >= 2 else _scaled(honest.delta, -1.0)
        feedback, decay = s.replica.feedback, s.replica.spec.compression.error_decay
        feedback.residual = {
            n: feedback.residual.get(n, torch.zeros_like(t)) + (poison[n] - t) / decay
            for n, t in honest.delta.items()
        }
        return honest


@dataclass
class Shirk:
    """Trains less than claimed (fewer steps, other batches, lower precision) and claims the full round."""

    steps: int | None = None  # None: all of them
    other_data: bool = False
    precision: torch.dtype | None = None
    rescale: bool = False  # adaptive: blow the delta up to an honest norm

    def play(self, s: Situation) -> RoundResult | None:
        spec = s.replica.spec
        did = s.train(
            steps=spec.inner_steps // self.steps if self.steps else None,
            seed=round_seed(spec.seed + 1, s.replica.worker_index, s.label) if self.other_data else None,
            precision=self.precision,
        )
        if did is None or did.commitment is None:
            return did
        commitment, _ = made_up(s, spec.inner_steps, did.commitment.trace)
        delta = (
            _scaled(did.delta, _honest_norm(s) / max(_norm(did.delta), 1e-12)) if self.rescale else did.delta
        )
        return replace(did, delta=delta, steps=spec.inner_steps, commitment=commitment)


@dataclass
class SkipSegment:
    """Trains honestly but for one trace segment a round, drawn at random, where it takes one step of
    ``every`` (none would leave two equal trace hashes): the least shirking a trace can hide. With
    ``every`` = 1 there is nothing to skip, and it trains honestly."""

    def play(self, s: Situation) -> RoundResult | None:
        spec = s.replica.spec
        every = trace_every(spec)
        segments = -(-spec.inner_steps // every)
        first = random.Random(f"{spec.seed}/{s.replica.worker_index}/{s.label}").randrange(segments) * every
        return s.train(skip=range(first + 1, first + every))


@dataclass
class Jump:
    rounds: int = 0

    def play(self, s: Situation) -> RoundResult | None:
        self.rounds += 1
        honest = s.train()
        if honest is None or self.rounds <= JUMP_AFTER:
            return honest
        return replace(honest, delta=_scaled(honest.delta, -SCALE))


@dataclass
class FakeTrace:
    last: RoundResult | None = None

    def play(self, s: Situation) -> RoundResult | None:
        if self.last is None:
            self.last = s.train()
            return self.last
        return _fake(s, self.last.delta)


class Framer:
    """Trains honestly; re-runs what it is handed as a peer, then reports its last hash changed: the
    dispute is the last segment it re-ran, where the core node's re-run clears the accused."""

    def play(self, s: Situation) -> RoundResult | None:
        return s.train()

    @staticmethod
    def vouch(hashes: list[str]) -> list[str]:
        return [*hashes[:-1], f"{int(hashes[-1], 16) ^ 1:0{TRACE_HEX}x}"]


@dataclass(frozen=True)
class Kind:
    family: str
    make: Callable[[], Adversary]


KINDS: dict[str, Kind] = {
    "zeros": Kind("lazy", Zeros),
    "noise": Kind("lazy", Noise),
    "stale": Kind("lazy", Stale),
    "free-rider": Kind("free-rider", FreeRider),
    "scaled": Kind("poisoner", lambda: Transform(lambda d, s: _scaled(d, SCALE))),
    "sign-flip": Kind("poisoner", lambda: Transform(lambda d, s: _scaled(d, -1.0))),
    "alie": Kind("poisoner", lambda: Transform(_alie)),
    "forged-residual": Kind("poisoner", ForgedResidual),
    "few-steps": Kind("shirker", lambda: Shirk(steps=SHIRK)),
    "other-data": Kind("shirker", lambda: Shirk(other_data=True)),
    "bf16": Kind("shirker", lambda: Shirk(precision=torch.bfloat16)),
    "skip-segment": Kind("shirker", SkipSegment),
    "adaptive": Kind("adaptive", lambda: Shirk(steps=SHIRK, rescale=True)),
    "jump": Kind("adaptive", Jump),
    "fake-trace": Kind("adaptive", FakeTrace),
    "framer": Kind("false accuser", Framer),
}
TRAINING_KINDS = [k for k, kind in KINDS.items() if kind.family != "false accuser"]  # cheat at training


def get(name: str) -> Adversary:
    """A fresh adversary of kind ``name`` (each keeps its own memory of earlier rounds)."""
    if name not in KINDS:
        raise BadRequest(f"unknown adversary {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name].make()


__all__ = ["KINDS", "TRAINING_KINDS", "Adversary", "get", "made_up"]
