"""A DiLoCo worker: inner steps on its shard, a compressed pseudo-gradient up, a compressed update down.

One round, as the worker sees it (``label`` is the round it contributes to)::

    y = θ_start; repeat H times (or until round_seconds): y = inner step on a batch of this shard
    wait until round ``label`` is published; replica ← θ_label (apply its update, check the hash)
    Δ = θ_start - y;  submit(label, compress(Δ + residual))          # error feedback keeps the rest
    synchronous:  wait for round label + 1, replica ← θ_label+1, θ_start = θ_label+1
    overlap:      θ_start = θ_label - Δ (our own step stands in for the average we don't have yet),
                  and the next round's compute starts while this exchange is still in flight

The worker holds a replica of the global model and outer optimizer (``GlobalReplica``), so per
round it receives only the aggregated compressed update; the whole state is fetched only to join
or to resync. The inner optimizer's state (``optimizers.py``: AdamW's moments, Muon's momentum) lives
across rounds, as in DiLoCo; a replacement task starts it afresh.

Each contribution carries a ``Commitment`` (``commitment.py``): inner steps run in deterministic mode
and are traced, and the commitment names the error-feedback residual the delta is compressed with and
the one it leaves (``Replica.seal``). When the receipt says the contribution was drawn for audit, the
worker uploads the drawn segment's states (and, for a peer audit, the next segments' too), the final
state and both residuals, and names them with ``submit_audit_state``; a state it did not keep it
re-derives by re-running its own steps from the nearest one it kept (``Replica.rerun``, in its model,
which it then puts back as it was: synchronous rounds answer before the next one starts). Between
rounds it re-runs what the aggregator hands it as another worker's peer (``peer_audit.py``). A task
whose config names an ``adversary`` plays that cheater instead (``adversaries.py``: tests and demos only).

Memory (``placement.py``): the model and its optimizer on the device, as a plain training loop holds
them; the global replica, the outer momentum, the residual and the round's start in host memory.
"""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpuflex.data.fetch import FetchedShards, ShardReader
from gpuflex.errors import BadRequest, Conflict
from gpuflex.market.memory import OPTIMIZER_BYTES
from gpuflex.privacy import dp
from gpuflex.protocol.messages import AuditStateSubmit, Commitment, ContributionSubmit, RoundState, TaskConfig
from gpuflex.train.commitment import (
    RoundTrace,
    Tracer,
    deterministic,
    device_class,
    load_state,
    residual_hash,
    trace_every,
    training_state,
)
from gpuflex.train.compression import ErrorFeedback, get_compressor
from gpuflex.train.data import round_seed
from gpuflex.train.device_group import DataParallel, DeviceGroup
from gpuflex.train.optimizers import InnerOptimizer, inner_optimizer
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.placement import host, snapshot_stride, training_device
from gpuflex.train.precision import InnerStep
from gpuflex.train.pretrained import model_directory
from gpuflex.train.recipes import Recipe, TaskData, build_model, for_task, shards
from gpuflex.train.schedule import set_lr
from gpuflex.train.secure import SecureWorker
from gpuflex.train.sharding import Sharded
from gpuflex.train.sync import sync
from gpuflex.train.trainable import trainable
from gpuflex.train.transport import Transport, as_stored, fetch_verified, wait_for_round

if TYPE_CHECKING:
    from gpuflex.train.adversaries import Adversary
    from gpuflex.train.peer_audit import PeerAuditor

GRAD_CLIP = 1.0  # max gradient norm of an inner step, as in nanoGPT: keeps early steps from blowing up
# A worker that starts a time-budgeted round late trains what is left of it, but at least this share of
# the budget: a replacement joining past the budget got in one step from a fresh AdamW (which moves every
# weight by the whole lr), and in a chaos test such an honest delta raised its own batch's loss from 0.85
# to 1.32 and was convicted. (Sitting the round out instead stalls it: the aggregator waits for a worker
# whose lease predates the round until the round's timeout.)
LATE_MIN_SHARE = 0.25

Params = dict[str, Tensor]


@dataclass
class WorkerSummary:
    contributed: list[int] = field(default_factory=list)  # rounds whose contribution was accepted
    stale: list[int] = field(default_factory=list)  # rounds that closed before the contribution arrived
    tokens: int = 0  # tokens trained on in accepted contributions
    bytes_sent: int = 0  # pseudo-gradient bytes uploaded, stale ones included
    bytes_received: int = 0  # updates and checkpoints downloaded (the dataset not counted)
    compute_s: float = 0.0  # time spent in inner steps
    peer_audit_s: float = 0.0  # time spent re-running other workers' segments as their peer
    secure_s: float = 0.0  # under secure aggregation: waiting for the round's shares after training, masking
    wall_s: float = 0.0  # from the first round's start (joined) to the end
    finished: bool = False  # the job finished (rather than this worker being told to stop)
    peak_memory_mb: float = 0.0  # the training device's peak allocation (CUDA), or the process's peak RSS

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class RoundResult:
    delta: Params  # θ_start - y
    steps: int  # claimed: an adversary may claim more than it did
    train_loss: float
    compute_s: float
    commitment: Commitment | None = None  # None for a follower rank (its result is dropped)
    trace: RoundTrace | None = None  # the states kept to answer an audit, and how to re-derive the rest
    residual: Params = field(default_factory=dict)  # the error feedback it was compressed with (``seal``)
    residual_out: Params = field(default_factory=dict)  # ... and what that compression left
    trace_s: float = 0.0  # of compute_s: building the commitment (hashing and copying states)

    def audit_state(self, segment: int, count: int = 1) -> bytes | None:
        """The blob answering an audit of ``segment`` and, for a peer, the ``count - 1`` after it (None:
        no such segment)."""
        state = (
            None
            if self.trace is None
            else self.trace.answer(segment, count, self.residual, self.residual_out)
        )
        return None if state is None else state.to_bytes()


@dataclass(frozen=True)
class Rerun:
    """How a round was trained, to re-run its steps for an audit: its batches' seed, its steps' numerics,
    the steps it skipped (a shirker's), each segment's learning rates, and its steps."""

    seed: int
    inner: InnerStep
    skip: range
    lrs: tuple[list[float], ...]
    every: int
    steps: int


@dataclass(frozen=True)
class Situation:
    """What an adversary playing this worker sees of a round (``adversaries.py``)."""

    replica: Replica
    start: Params
    label: int
    should_stop: Callable[[], bool]
    late_s: float = 0.0
    peers: tuple[Params, ...] = ()  # honest deltas of this round, for colluders (the benchmark gives them)

    def train(self, **shirk: object) -> RoundResult | None:
        """Train this round as assigned, or shirking (``Replica.train_round``'s overrides)."""
        return self.replica.train_round(self.start, self.label, self.should_stop, late_s=self.late_s, **shirk)


class Replica:
    """This worker's training model, inner optimizer, error feedback and global replica."""

    def __init__(
        self,
        config: TaskConfig,
        recipe: Recipe,
        data: TaskData,
        group: DeviceGroup | None = None,
        *,
        after_step: Callable[[float], None] | None = None,
    ):
        self.spec = config.training
        self.after_step = after_step  # called with each inner step's duration (a slowdown, a fault)
        self.worker_index = config.worker_index
        self.recipe = recipe
        self.data = data
        self.group = group
        self.device = group.device if group else training_device()
        model = build_model(self.spec, recipe)
        self.global_ = GlobalReplica(model, self.spec)  # a host copy of the trained parameters, whole
        self.model = model if group else model.to(self.device)
        self.trained = group.place(model) if group else self.model  # what forward/backward go through
        # a state's tensors whole, one at a time: gathered from a sharded replica's ranks
        self.full_tensors = group.full_tensors if group else dict.items
        self.inner = InnerStep.for_spec(self.spec, self.device)
        self.optimizer = inner_optimizer(self.model, self.spec)
        compressor = get_compressor(self.spec.compression)
        self.feedback = ErrorFeedback(compressor, decay=self.spec.compression.error_decay)
        self.decode = self.global_.decoder(compressor)
        self.dp_clip = config.dp.clip if config.dp is not None else None  # privacy.dp: each delta's bound

    @property
    def tokens_per_step(self) -> int:
        return self.data.tokens_per_batch * (self.group.size if self.group else 1)

    def global_params(self) -> Params:
        """The global weights, in host memory: the replica's own tensors, which change only when it
        catches up (after a synchronous round's contribution is answered), so a round starts from them
        without a copy."""
        return self.global_.parameters()

    def snapshot_stride(self) -> int:
        """Which boundaries the tracer keeps (``placement.snapshot_stride``). Every one when the worker
        cannot re-run in its model at answer time: with ``overlap`` it trains the next round by then, and a
        replica over several ranks re-runs only with all of them."""
        if self.spec.overlap or self.group is not None:
            return 1
        per_parameter = 4 + OPTIMIZER_BYTES[self.spec.optimizer_states]
        size = sum(p.numel() for p in trainable(self.model).values()) * per_parameter
        segments = -(-self.spec.inner_steps // trace_every(self.spec))
        return snapshot_stride(int(size), segments)

    def seal(self, result: RoundResult) -> tuple[bytes, RoundResult]:
        """Compress ``result.delta`` with error feedback; the commitment names the residual used and the
        one left, which the result keeps to answer an audit (they bind the blob to the trace, and chain
        this contribution to the next).

        With ``privacy.dp`` the delta is clipped to its L2 bound first: the clipped delta is what this
        owner releases. Error feedback then adds what earlier compressions left of earlier clipped deltas;
        that residual stays here, and the aggregator clips what it decodes again, so a round's
        contribution never counts for more than the bound however much residual it carries."""
        if self.dp_clip is not None:
            result = replace(result, delta=dp.clip(result.delta, self.dp_clip)[0])
        residual, chain = self.feedback.residual, self.feedback.compressions  # ``compress`` replaces them
        blob = self.feedback.compress(result.delta)
        if result.commitment is None:
            return blob, result
        left = self.feedback.residual
        update = {"residual": residual_hash(residual), "residual_out": residual_hash(left), "chain": chain}
        commitment = result.commitment.model_copy(update=update)
        return blob, replace(result, commitment=commitment, residual=residual, residual_out=left)

    def train_round(
        self,
        start: Params,
        label: int,
        should_stop: Callable[[], bool],
        *,
        late_s: float = 0.0,
        steps: int | None = None,
        seed: int | None = None,
        precision: torch.dtype | None = None,
        skip: range = range(0),
    ) -> RoundResult | None:
        """Inner steps from ``start``: ``inner_steps`` of them, or as many as fit in ``round_seconds``.

        ``late_s``: how long ago the round began (it was published). A time-budgeted worker that joins
        or catches up late trains only for the rest of the round, so it does not hold the round up, but
        at least ``LATE_MIN_SHARE`` of it.
        ``steps``, ``seed`` (of the batches) and ``precision`` (autocast dtype; else ``self.inner``'s)
        override what the job assigns, and the steps in ``skip`` (never the first) are drawn and traced
        but not taken: only ``adversaries`` use them, to shirk.

        Over several ranks every rank calls it, a follower with ``start`` empty (rank 0 hands every rank
        its weights); rank 0's result alone carries the replica's delta and commitment.
        """
        if self.spec.round_seconds is not None:
            late_s = min(late_s, (1 - LATE_MIN_SHARE) * self.spec.round_seconds)
        began = time.monotonic() - late_s
        rank = self.group.rank if self.group else 0
        self._load(start, label)
        seed = round_seed(self.spec.seed, self.worker_index, label, rank) if seed is None else seed
        generator = torch.Generator().manual_seed(seed)
        # rank 0 commits for the replica (the others trace with it: a sharded state is gathered by all);
        # the others' batches follow from their seeds, so an auditor re-runs all of them (``audit.py``)
        every = trace_every(self.spec)
        stride = self.snapshot_stride()
        tracer = Tracer(start, seed, every, self.device_class(), stride, self.full_tensors)
        budget = self.spec.inner_steps if steps is None else steps
        self.model.train()
        losses: list[float] = []
        inner = self.inner if precision is None else replace(self.inner, dtype=precision)
        with deterministic():
            while len(losses) < budget and not self._out_of_time(began, len(losses)):
                if should_stop():
                    return None
                step_began = time.monotonic()
                set_lr(self.optimizer, self.spec, (label + self._done(began, len(losses))) / self.spec.rounds)
                batch = tuple(t.to(self.device) for t in self.data.sample(generator))
                tracer.before_step(self.model, self.optimizer, batch)
                losses.append(
                    losses[-1]
                    if len(losses) in skip
                    else step(self.recipe, self.trained, self.model, self.optimizer, batch, inner=inner)
                )
                tracer.after_step(self.model, self.optimizer)
                if self.after_step is not None:
                    self.after_step(time.monotonic() - step_began)
        self.optimizer.zero_grad(set_to_none=True)  # not needed until the next step: memory for what follows
        final = {n: p.detach() for n, p in trainable(self.model).items()}
        delta = {n: start[n] - p.cpu() for n, p in self.full_tensors(final)}  # rank 0's, on its host
        how = Rerun(seed, inner, skip, tuple(tracer.lrs), every, len(losses))
        # a replica over several ranks keeps every boundary: a re-run would need all of them
        rerun = None if self.group else functools.partial(self.rerun, how)
        commitment, trace = tracer.commit(self.model, self.optimizer, rerun)
        compute_s = time.monotonic() - began - late_s
        return RoundResult(
            delta,
            len(losses),
            sum(losses) / len(losses),
            compute_s,
            commitment if rank == 0 else None,
            trace if rank == 0 else None,
            trace_s=tracer.seconds,
        )

    def _load(self, start: Params, label: int) -> None:
        """Put the round's start weights into the model (on every rank of a replica over several)."""
        if self.group is None:
            with torch.no_grad():
                for name, p in trainable(self.model).items():
                    p.copy_(start[name], non_blocking=True)
            return
        if self.group.rank == 0:
            self.group.begin_round(label)
        self.group.load(trainable(self.model), start)

    def rerun(self, how: Rerun, boundary: int, state: Params, until: int) -> tuple[list[Params], Params]:
        """Re-run a round's steps in this model from ``state`` at ``boundary`` to boundary ``until``: the
        states at each boundary after ``boundary`` (host copies), and the model's own state, put back."""
        live = {k: host(v) for k, v in training_state(self.model, self.optimizer).items()}
        load_state(self.model, self.optimizer, state)
        generator = torch.Generator().manual_seed(how.seed)
        first, last = boundary * how.every, min(until * how.every, how.steps)
        for _ in range(first):  # the batches before it: the stream's draws must be the same
            self.data.sample(generator)
        states = []
        self.model.train()
        with deterministic():
            for k in range(first, last):
                batch = tuple(t.to(self.device) for t in self.data.sample(generator))
                for group in self.optimizer.param_groups:
                    group["lr"] = how.lrs[k // how.every][k % how.every]
                if k not in how.skip:
                    step(self.recipe, self.trained, self.model, self.optimizer, batch, inner=how.inner)
                if (k + 1) % how.every == 0 or k + 1 == how.steps:
                    states.append({n: host(v) for n, v in training_state(self.model, self.optimizer).items()})
        load_state(self.model, self.optimizer, live)
        return states, live

    def device_class(self) -> str:
        """Its commitment's hardware class: a replica over several ranks averages their gradients by an
        all-reduce, whose sums an auditor's one process does not reproduce bit for bit."""
        own = device_class(self.device, self.inner.label, self.spec.quantize_base)
        return f"{own}/{self.group.kind}{self.group.size}" if self.group else own

    def _done(self, began: float, steps: int) -> float:
        """The share of this round's work done: its steps, or its time budget."""
        if self.spec.round_seconds is None:
            return steps / self.spec.inner_steps
        return min(1.0, (time.monotonic() - began) / self.spec.round_seconds)

    def _out_of_time(self, began: float, steps: int) -> bool:
        budget = self.spec.round_seconds
        return budget is not None and steps > 0 and time.monotonic() - began >= budget


def step(
    recipe: Recipe,
    trained: torch.nn.Module,
    model: torch.nn.Module,
    optimizer: InnerOptimizer,
    batch,
    *ranks,
    inner: InnerStep = InnerStep(),
) -> float:
    """One inner step on ``batch`` (the worker's, and an auditor's re-run of it); returns its loss.

    ``inner``: the step's precision and micro-batches (``precision.py``). ``ranks``: the other ranks'
    batches of a replica over several devices, in an auditor's re-run: the step takes the mean of all the
    batches' gradients, as the replica's all-reduce did."""
    optimizer.zero_grad(set_to_none=True)
    scaler = inner.scaler()
    loss = inner.backward(recipe.loss, trained, batch, scaler)
    for other in ranks:
        inner.backward(recipe.loss, trained, other, scaler)
    if ranks:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(1 + len(ranks))
    if scaler is not None:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    if scaler is not None:
        scaler.step(optimizer)  # skipped when the gradients overflowed
    else:
        optimizer.step()
    return loss


def run_worker(
    config: TaskConfig,
    transport: Transport,
    *,
    poll_interval_s: float = 0.2,
    should_stop: Callable[[], bool] = lambda: False,
    after_step: Callable[[float], None] | None = None,
    reader: ShardReader | None = None,
) -> WorkerSummary:
    """Contribute to every round from the latest published one until the job finishes or ``should_stop``.

    ``after_step`` is called after each inner step with its duration in seconds, inside the round's
    time: ``gpuflex.train.local`` sleeps there to make a worker k times slower. ``reader`` opens a
    prepared dataset's shards (default: fetched through ``transport`` into memory).
    """
    blobs: dict[str, bytes] = {}

    def fetch(digest: str) -> bytes:
        blobs[digest] = fetch_verified(transport, digest)
        return blobs[digest]

    reader = reader or FetchedShards(transport.get_blob)
    stored, unseal = as_stored(transport)
    with model_directory(config.training, stored, reader.cache, unseal) as model_dir:
        recipe, data = for_task(config, fetch, reader, model_dir, training_device())
        return _work(
            config,
            transport,
            recipe,
            data,
            blobs,
            fetch,
            reader,
            model_dir,
            poll_interval_s,
            should_stop,
            after_step,
        )


def _work(
    config: TaskConfig,
    transport: Transport,
    recipe: Recipe,
    data: TaskData,
    blobs: dict[str, bytes],
    fetch: Callable[[str], bytes],
    reader: ShardReader,
    model_dir: Path | None,
    poll_interval_s: float,
    should_stop: Callable[[], bool],
    after_step: Callable[[float], None] | None,
) -> WorkerSummary:
    """``run_worker`` once the task's recipe and data are built (its model directory written out)."""
    group = None
    if config.training.local_devices > 1:
        kind = Sharded if config.training.shard else DataParallel
        group = kind.start(config, blobs, model_dir, _follow)
    replica = Replica(config, recipe, data, group, after_step=after_step)
    if replica.inner.label != config.training.precision:
        transport.log(
            f"precision {config.training.precision} needs a CUDA device; this {replica.device.type} node "
            f"trains in {replica.inner.label}, and its commitments say so"
        )
    adversary = None
    if config.adversary:
        from gpuflex.train import adversaries  # they import this module: a cheater trains with a Replica

        adversary = adversaries.get(config.adversary)
    loop = _Loop(replica, transport, WorkerSummary(), poll_interval_s, should_stop, adversary)
    if config.secure_aggregation is not None:
        loop.secure = SecureWorker.start(config, transport, poll_interval_s, loop.stopping)
    if config.training.verification.peer_segments:
        from gpuflex.train.peer_audit import PeerAuditor  # it imports this module (through the audit)

        vouch = getattr(adversary, "vouch", list)  # what it reports of its re-runs: what they gave, if honest
        loop.peers = PeerAuditor(
            config.training, recipe, transport, shards(config, recipe, fetch, reader), vouch
        )
    try:
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange") as exchange,
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="secagg") as keys,
        ):
            loop.exchange, loop.keys = exchange, keys
            loop.run()
    finally:
        if group is not None:  # followers wait at a round boundary unless we stopped mid-round
            group.close(abort=not loop.summary.finished)
    if loop.began is not None:
        loop.summary.wall_s = time.monotonic() - loop.began
    if loop.peers is not None:
        loop.summary.peer_audit_s = loop.peers.seconds
    loop.summary.peak_memory_mb = _peak_memory_mb(replica.device)
    return loop.summary


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux counts kB


def _follow(group: DeviceGroup, config: TaskConfig, blobs: dict[str, bytes], model_dir: Path | None) -> None:
    """Ranks 1..N-1 of a replica: build the task's model as rank 0 did (from the job's model directory, if
    it has one) and train every round rank 0 starts, in lockstep with it."""
    recipe, data = for_task(config, blobs.__getitem__, model_dir=model_dir, device=group.device)
    replica = Replica(config, recipe, data, group)
    while (label := group.next_round()) is not None:
        replica.train_round({}, label, should_stop=lambda: False)


@dataclass
class _Loop:
    replica: Replica
    transport: Transport
    summary: WorkerSummary
    poll_interval_s: float
    should_stop: Callable[[], bool]
    adversary: Adversary | None = None
    exchange: ThreadPoolExecutor | None = None
    pending: Future | None = None
    began: float | None = None  # when this worker had joined and began its first round
    excluded: bool = False  # the transport refused us: the lease ended
    peers: PeerAuditor | None = None  # with peer audits: this task's side of them
    secure: SecureWorker | None = None  # privacy.secure_aggregation: this task's side of it
    keys: ThreadPoolExecutor | None = None  # runs a round's key and share exchange while it trains
    sessions: dict[int, Future] = field(default_factory=dict)  # by round: SecureWorker.prepare

    def stopping(self) -> bool:
        return self.excluded or self.should_stop()

    def wait(self, newer_than: int) -> RoundState | None:
        """The next round; meanwhile, re-run what the aggregator asks of this task as a peer."""
        idle = self.peers.work if self.peers is not None else None
        return wait_for_round(self.transport, newer_than, self.poll_interval_s, self.stopping, idle)

    def catch_up(self, state: RoundState) -> None:
        self.summary.bytes_received += sync(self.replica.global_, self.transport, state, self.replica.decode)

    def run(self) -> None:
        state = self.wait(-1)
        if state is None or state.finished:
            self.summary.finished = state is not None
            return
        self.catch_up(state)
        self.began = time.monotonic()
        start, label, late_s = self.replica.global_params(), state.round, state.age_s
        self.transport.log(f"joined at round {label}, {late_s:.1f}s after it was published")
        while (result := self.train(start, label, late_s)) is not None:
            late_s = 0.0
            self.summary.compute_s += result.compute_s
            state = self.wait(label - 1)  # round ``label`` must be published to contribute to it
            if state is None or state.finished:
                break
            if state.round > label:  # the round closed while we trained: start again from the newest
                self.summary.stale.append(label)
                self.catch_up(state)
                start, label, late_s = self.replica.global_params(), state.round, state.age_s
                result = None
                continue
            self.catch_up(state)
            self.submit(label, result)
            if self.replica.spec.overlap:
                start = {n: p - result.delta[n] for n, p in self.replica.global_params().items()}
                label += 1
                continue
            self.settle()
            state = self.wait(label)
            if state is None or state.finished:
                break
            self.catch_up(state)
            start, label, late_s = self.replica.global_params(), state.round, state.age_s
            result = None  # answered: its kept states go before the next round keeps its own
        self.settle()
        self.summary.finished = bool(state and state.finished)

    def train(self, start: Params, label: int, late_s: float) -> RoundResult | None:
        """This round's result: honest training, or what the adversary this task plays makes of it."""
        if self.secure is not None and self.keys is not None:
            self.sessions = {r: f for r, f in self.sessions.items() if r >= label}  # older rounds closed
            self.sessions.setdefault(label, self.keys.submit(self.secure.prepare, label))
        if self.adversary is None:
            return self.replica.train_round(start, label, self.stopping, late_s=late_s)
        return self.adversary.play(Situation(self.replica, start, label, self.stopping, late_s))

    def submit(self, label: int, result: RoundResult) -> None:
        """Compress and hand the contribution to the exchange thread (after the previous one is done)."""
        self.settle()
        blob, result = self.replica.seal(result)
        tokens = result.steps * self.replica.tokens_per_step
        submission = ContributionSubmit(
            round=label,
            delta="0" * 64,
            tokens=tokens,
            steps=result.steps,
            train_loss=result.train_loss,
            commitment=result.commitment,
        )
        self.pending = self.exchange.submit(self._send, blob, submission, result)

    def _send(self, blob: bytes, submission: ContributionSubmit, result: RoundResult) -> None:
        session = None
        if self.secure is not None:
            began = time.monotonic()
            session = self.sessions.pop(submission.round).result()
            if session is None:
                self.replica.feedback.revert()  # nothing was sent: the residual stays as it was
                self.transport.log(
                    f"round {submission.round}: not in the round's secure aggregation (it closed, or went on "
                    "without this owner): no contribution"
                )
                return
            try:
                blob, dropped = self.secure.masked_blob(session, self.replica.decode(blob))
            except BadRequest as err:  # the roster's grid does not fit this model: nothing to send
                self.replica.feedback.revert()
                self.transport.log(f"round {submission.round}: secure aggregation: {err.message}")
                return
            self.replica.feedback.owe(dropped)  # what the ring's grid rounded off is sent later
            self.summary.secure_s += time.monotonic() - began
        submission = submission.model_copy(update={"delta": self.transport.put_blob(blob)})
        try:
            receipt = self.transport.submit_contribution(submission)
        except Conflict as err:  # our lease ended (excluded by a verdict, or re-leased): stop here
            self.transport.log(f"round {submission.round}: contribution refused, stopping: {err.message}")
            self.excluded = True
            return
        self.summary.bytes_sent += len(blob)
        if receipt.accepted:
            self.summary.contributed.append(submission.round)
            self.summary.tokens += submission.tokens
        else:
            self.replica.feedback.revert()
            self.summary.stale.append(submission.round)
        self.transport.log(
            f"round {submission.round}: {result.steps} steps, train loss {result.train_loss:.4f}, "
            f"sent {len(blob) / 1e3:.1f} kB ({self.replica.spec.compression.label}), "
            f"compute {result.compute_s:.1f}s, "
            + ("accepted" if receipt.accepted else "stale: the round had closed")
        )
        if receipt.audit_segment is not None:
            self.answer_audit(submission.round, receipt.audit_segment, result)
        if session is not None and receipt.accepted:
            self.secure.reveal(session)

    def answer_audit(self, round: int, segment: int, result: RoundResult) -> None:
        """Upload the drawn segment's states, the final state and both residuals (a cheater's: its own)."""
        blob = result.audit_state(segment, max(1, self.replica.spec.verification.peer_segments))
        if blob is None:
            self.transport.log(f"round {round}: drawn for audit at segment {segment}, which we cannot answer")
            return
        state = self.transport.put_blob(blob)
        self.transport.submit_audit_state(AuditStateSubmit(round=round, segment=segment, state=state))
        self.transport.log(f"round {round}: drawn for audit, uploaded the state at segment {segment}")

    def settle(self) -> None:
        """Wait for the exchange in flight, re-raising its error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
