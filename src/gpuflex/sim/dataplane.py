"""The data plane: the bytes a simulated job mix moves through the coordinator and the object store.

Today every blob a task or a consumer reads or writes passes through the coordinator (``/v1/blobs``);
with direct transfers (presigned URLs) the store serves the same bytes and the coordinator carries only
control traffic. What each blob weighs follows from the job spec and the code that writes it:

- a task's start (a worker or an aggregator, every re-assignment included): the base model directory
  (``model.from``: its parameters in its saved dtype) unless the node's cache holds that base from its
  last task (a cache of one base per node: a lower bound on its hits); the job's corpus (``data.source``:
  one blob of at most ``data.max_bytes``, counted at that); and its way to the newest round
  (``train.sync``: within ``REPLAY_ROUNDS`` of round 0 the updates alone, else the newest checkpoint
  and the updates after it). The first aggregator builds round 0 and writes its checkpoint;
- a published round with ``C`` contributors: ``C`` pseudo-gradients written and read by the aggregator,
  its update written and read by the ``C`` workers (trained parameters × ``pricing.bytes_per_value``, the
  market's own wire model), a checkpoint at every ``checkpoint_every``-th round and the last (trained
  parameters in fp32 and the outer momentum, ``train.outer``), a prepared dataset's tokens as they are
  trained on, and audit states: ``audit_rate`` of the contributions write one, the auditor reads it,
  counted at that expectation so that the run's random draws stay the engine's;
- a completed job: its consumer fetches the last checkpoint;
- deployments (the engine runs none: a closed-form account): each replica fetches its model directory
  when placed, and again each time its node leaves, once per mean community session;
- control: each online node's signed heartbeat at the fleet's interval and each leased task's round
  polls, read off the report's samples; with direct transfers, one call per blob for its URL.

Round traffic is booked at each round's end, so a stretch of rounds (one engine event) spreads over the
buckets it spans; rates are means over buckets of ``bucket_s``. What it leaves out: rounds lost with
their aggregator (their contributions were sent), the validation split, secure aggregation's masks.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from gpuflex.market.liveness import fleet_interval_s
from gpuflex.market.pricing import VOCAB, bytes_per_value, tokens_per_step, trained_count
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.sim.scenario import Network

REPLAY_ROUNDS = 8  # train.sync.MAX_UPDATES_TO_REPLAY: the sim may not import train
# commitment.AuditState.to_bytes of a middle segment: its start and end states (fp32 weights and
# AdamW's two moments, 12 bytes a trained parameter each), the final state (12), the residual, the
# round's origin and the residual left (4 each); 44 for the first segment, 36 for the last.
AUDIT_STATE_BYTES_PER_PARAM = 48
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, None: 4}  # a model directory of unknown dtype: fp32
VOCAB_UINT16 = 1 << 16  # data.manifest: tokens as uint16 up to this vocabulary, else uint32
# Wire sizes (request, answer), measured once by sending the real clients' calls through httpx's
# MockTransport, with uvicorn's answer headers: a signed ``NodeClient.heartbeat`` holding one lease,
# and ``TaskClient.latest_round`` answered a ``RoundState`` naming an update and a checkpoint.
HEARTBEAT_BYTES = (550, 180)
ROUND_POLL_BYTES = (240, 445)
POLL_INTERVAL_S = 0.2  # train.worker's poll_interval_s: every leased task counted as polling throughout
# ASSUMPTION (direct transfers are not built yet): the call that hands out one blob's presigned URL.
TRANSFER_CALL_BYTES = (400, 600)

SERVED = (
    "base_models",
    "corpus",
    "joins",
    "shards",
    "updates",
    "contributions",
    "audit_states",
    "fetches",
    "deployments",
)
WRITTEN = ("contributions", "updates", "checkpoints", "audit_states")


@dataclass(frozen=True)
class Blobs:
    """What one job's blobs weigh, in bytes."""

    base: int  # the model directory of ``model.from``; 0 for a model built from the job's seed
    checkpoint: int
    pseudo_gradient: int  # a contribution, and the aggregator's update: the same codec both ways
    audit_state: int
    audit_rate: float
    corpus: int  # per task start
    shard_round: int  # a worker's tokens of one round, from a prepared dataset
    rounds: int
    checkpoint_every: int

    @property
    def served_per_contribution(self) -> float:
        """Read for each contribution: by the aggregator, the round's update by its worker, the worker's
        shards, and the expected audit state by the auditor."""
        return 2 * self.pseudo_gradient + self.shard_round + self.audit_rate * self.audit_state

    @property
    def written_per_contribution(self) -> float:
        return self.pseudo_gradient + self.audit_rate * self.audit_state

    @classmethod
    def of(cls, spec: JobSpec) -> Blobs:
        training = spec.training
        trained = trained_count(training) or 0
        size = training.model.size
        vocab = size.vocab if size is not None and size.vocab else VOCAB
        prepared = spec.data.prepared is not None
        return cls(
            base=0 if size is None else size.parameters * DTYPE_BYTES[size.dtype],
            checkpoint=trained * (8 if training.outer_momentum > 0 else 4),
            pseudo_gradient=math.ceil(trained * bytes_per_value(training)),
            audit_state=AUDIT_STATE_BYTES_PER_PARAM * trained,
            audit_rate=training.verification.audit_rate,
            corpus=spec.data.max_bytes if spec.data.source not in (None, "none") else 0,
            shard_round=training.inner_steps * tokens_per_step(training) * (2 if vocab <= VOCAB_UINT16 else 4)
            if prepared
            else 0,
            rounds=training.rounds,
            checkpoint_every=training.checkpoint_every,
        )

    def join(self, rounds_done: int) -> int:
        """Bytes a task fetches to reach round ``rounds_done`` (``train.sync``)."""
        if rounds_done <= REPLAY_ROUNDS:
            return rounds_done * self.pseudo_gradient
        return self.checkpoint + rounds_done % self.checkpoint_every * self.pseudo_gradient

    def checkpoints(self, before: int, after: int) -> int:
        """Checkpoints written publishing rounds ``before + 1 .. after``: every ``checkpoint_every``-th and
        the last."""
        every = self.checkpoint_every
        return after // every - before // every + (after >= self.rounds and self.rounds % every != 0)


def model_bytes(spec: DeploymentSpec) -> int:
    """What a replica downloads: the model directory the deployment serves, in its saved dtype."""
    size = spec.model.size
    assert size is not None, "the scenario checks that a deployment has model.size"
    return size.parameters * DTYPE_BYTES[size.dtype]


class DataPlane:
    """The account the engine feeds: bytes the store serves and is written, by kind and by time bucket."""

    def __init__(self, specs: list[JobSpec], nodes: int, horizon_s: float, bucket_s: float):
        self.blobs = [Blobs.of(s) for s in specs]
        bases: dict[tuple, int] = {}  # one id per distinct model directory
        model = [s.training.model for s in specs]
        self.base_id = [
            bases.setdefault((m.from_, m.uploaded), len(bases)) if b.base else -1
            for m, b in zip(model, self.blobs, strict=True)
        ]
        self.cached = array("q", [-1]) * nodes  # the base each node fetched last
        self.bucket_s, self.horizon_s = bucket_s, horizon_s
        buckets = max(1, math.ceil(horizon_s / bucket_s))
        self.served_series, self.written_series = [0.0] * buckets, [0.0] * buckets
        # what tasks' starts, completed jobs and deployments fetch, by kind; rounds are counted per
        # template (``by_kind`` adds them up)
        self.served = dict.fromkeys(SERVED, 0.0)
        self.first_checkpoints = 0.0  # round 0's, written by each job's first aggregator
        self.transfers = 0.0  # blobs moved: with direct transfers, each costs a call for its URL
        self.worker_rounds = [0] * len(specs)
        self.rounds = [0] * len(specs)
        self.checkpoints = [0] * len(specs)
        self.cache_hits = 0
        self.cache_saved = 0.0
        self.deployments: list[dict] = []

    def _bucket(self, t: float) -> int:
        return min(max(int(t // self.bucket_s), 0), len(self.served_series) - 1)

    def _serve(self, t: float, kind: str, nbytes: float, blobs: int = 1) -> None:
        if nbytes:
            self.served[kind] += nbytes
            self.served_series[self._bucket(t)] += nbytes
            self.transfers += blobs

    def task_started(
        self, t: float, template: int, node: int, rounds_done: int, *, first_aggregator: bool
    ) -> None:
        """A task was leased on ``node``: it fetches its base (unless cached), corpus and the newest round;
        the job's first aggregator builds round 0 and writes its checkpoint instead of joining."""
        blobs, base, served = self.blobs[template], self.base_id[template], self.served
        nbytes, transfers = blobs.corpus, blobs.corpus > 0
        served["corpus"] += blobs.corpus
        if base >= 0 and self.cached[node] == base:
            self.cache_hits += 1
            self.cache_saved += blobs.base
        elif base >= 0:
            self.cached[node] = base
            served["base_models"] += blobs.base
            nbytes, transfers = nbytes + blobs.base, transfers + 1
        if first_aggregator:
            self.first_checkpoints += blobs.checkpoint
            self.written_series[self._bucket(t)] += blobs.checkpoint
            transfers += 1
        elif rounds_done:
            join = blobs.join(rounds_done)
            served["joins"] += join
            nbytes, transfers = nbytes + join, transfers + 1 + min(rounds_done, REPLAY_ROUNDS)
        self.served_series[self._bucket(t)] += nbytes
        self.transfers += transfers

    def rounds_published(
        self, template: int, start: float, round_s: float, before: int, rounds: int, contributors: int
    ) -> None:
        """Rounds ``before + 1 .. before + rounds`` published, the k-th at ``start + k·round_s``, each with
        ``contributors`` pseudo-gradients: counted per template, and booked in the buckets of their ends."""
        blobs = self.blobs[template]
        checkpoints = blobs.checkpoints(before, before + rounds)
        self.worker_rounds[template] += rounds * contributors
        self.rounds[template] += rounds
        self.checkpoints[template] += checkpoints
        served = contributors * blobs.served_per_contribution
        written = contributors * blobs.written_per_contribution + blobs.pseudo_gradient
        written += checkpoints * blobs.checkpoint / rounds
        for b, n in rounds_per_bucket(len(self.served_series), self.bucket_s, start, round_s, rounds):
            self.served_series[b] += n * served
            self.written_series[b] += n * written

    def by_kind(self) -> tuple[dict[str, float], dict[str, float], float]:
        """Bytes served and written by kind, and the blobs moved, over the run so far."""
        served, written = dict(self.served), dict.fromkeys(WRITTEN, 0.0)
        written["checkpoints"] = self.first_checkpoints
        transfers = self.transfers
        for blobs, wr, rounds, checkpoints in zip(
            self.blobs, self.worker_rounds, self.rounds, self.checkpoints, strict=True
        ):
            audits = wr * blobs.audit_rate
            served["contributions"] += wr * blobs.pseudo_gradient  # the aggregator reads each
            served["updates"] += wr * blobs.pseudo_gradient  # each contributor reads the round's
            served["shards"] += wr * blobs.shard_round
            served["audit_states"] += audits * blobs.audit_state  # the auditor reads each
            written["contributions"] += wr * blobs.pseudo_gradient
            written["updates"] += rounds * blobs.pseudo_gradient
            written["audit_states"] += audits * blobs.audit_state
            written["checkpoints"] += checkpoints * blobs.checkpoint
            transfers += 3 * wr + rounds + 2 * audits + checkpoints
        return served, written, transfers

    def job_completed(self, t: float, template: int) -> None:
        """Its consumer fetches the last checkpoint (``gpuflex job fetch``)."""
        self._serve(t, "fetches", self.blobs[template].checkpoint)

    def run_deployments(self, specs: list[tuple[DeploymentSpec, int]], mean_session_s: float) -> None:
        """``count`` deployments of each spec through the whole horizon: each replica fetches its model when
        placed (the first bucket) and again once per mean community session (spread evenly)."""
        for spec, count in specs:
            nbytes, replicas = model_bytes(spec), count * spec.replicas
            again = replicas * self.horizon_s / mean_session_s
            self.served["deployments"] += (replicas + again) * nbytes
            self.served_series[0] += replicas * nbytes
            for b in range(len(self.served_series)):
                span = min(self.bucket_s, self.horizon_s - b * self.bucket_s)
                self.served_series[b] += again * nbytes * span / self.horizon_s
            self.transfers += replicas + again
            self.deployments.append(
                {
                    "name": spec.name,
                    "count": count,
                    "replicas": replicas,
                    "replica_starts": replicas + again,
                    "model_bytes": nbytes,
                    "bytes": (replicas + again) * nbytes,
                }
            )


def rounds_per_bucket(
    buckets: int, bucket_s: float, start: float, step: float, count: int
) -> Iterator[tuple[int, int]]:
    """How many of the times ``start + step``, ``start + 2·step`` .. ``start + count·step`` fall in each
    bucket of ``bucket_s`` (past the last bucket: in the last), as (bucket, how many), one per bucket."""
    last = buckets - 1
    k = 1
    while k <= count:
        b = min(int((start + k * step) // bucket_s), last)
        if b == last:
            n = count - k + 1
        else:  # the rounds from k whose end falls before this bucket's end (checked: floats round)
            n = max(1, min(count - k + 1, math.ceil(((b + 1) * bucket_s - start) / step) - k))
            while n > 1 and (start + (k + n - 1) * step) // bucket_s > b:
                n -= 1
        yield b, n
        k += n


def control_bytes(
    samples: list[tuple[float, int, int]], network: Network, horizon_s: float, bucket_s: float
) -> tuple[list[float], list[float], dict]:
    """Control traffic (into and out of the coordinator) per bucket from the report's samples (time, nodes
    online, nodes leased), each held until the next: heartbeats at the fleet's interval, round polls."""
    n = max(1, math.ceil(horizon_s / bucket_s))
    inbound, outbound = [0.0] * n, [0.0] * n
    beats = polls = 0.0
    for (t, online, busy), (t_next, _, _) in itertools.pairwise(samples):
        span = min(t_next, horizon_s) - t
        if span <= 0:
            continue
        interval = fleet_interval_s(network.heartbeat_interval_s, online, network.heartbeat_max_rate_per_s)
        b_beats, b_polls = online * span / interval, busy * span / POLL_INTERVAL_S
        b = min(int(t // bucket_s), n - 1)
        inbound[b] += b_beats * HEARTBEAT_BYTES[0] + b_polls * ROUND_POLL_BYTES[0]
        outbound[b] += b_beats * HEARTBEAT_BYTES[1] + b_polls * ROUND_POLL_BYTES[1]
        beats, polls = beats + b_beats, polls + b_polls
    return inbound, outbound, {"heartbeats": beats, "round_polls": polls}
