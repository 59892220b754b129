"""Commitments: the trace a worker binds itself to as it trains a round, and the state it is audited on.

A worker commits to where it started (``start``: the hash of the round's parameters, the same hash as
``GlobalReplica.state_hash``), to the batches it drew in order (``data``), to its generator's seed and
hardware class, and to a *trace*: a 64-bit hash of its whole training state (parameters and the inner
optimizer's state: AdamW's moments, Muon's momentum) after every ``every`` inner steps and after the
last one. An auditor handed the state at the start of one segment re-runs ``every`` steps and must
land on the next trace hash (``audit.py``).

Re-runs reproduce bit for bit on the same hardware class because training here is deterministic:
the batches come from a generator seeded by (job seed, worker, round) (``data.round_seed``), dropout is
off by default, ``torch.use_deterministic_algorithms`` is on during inner steps, and the thread count is
fixed per process (``torch.set_num_threads`` by the agent's runner or ``train.local``): it is part of the
hardware class, since a CPU's reductions split work by thread.

The delta is bound to the trace too: the worker commits to the error-feedback residual it compresses
with (``residual_hash``), so the blob it sends is a function of the trace's last state, its start and
that residual, and an audit checks it (``audit.py``): training honestly and sending something else
(ALIE, any substitution) fails. The residual is chained: the worker also commits to the residual that
compression leaves (``residual_out``), which its next contribution must compress with (or an empty one,
from a fresh worker). The verifier checks the chain on every contribution, an audit that the residual
left is the one compression left; so a residual cannot be forged to bind a poisoned delta.

While it trains, the ``Tracer`` hashes the state at every segment boundary and keeps, in host memory, the
state at the round's start (the optimizer's; the parameters are the round's start the worker holds
anyway) and at every ``stride``-th boundary after it (``placement.snapshot_stride``: every one for a small
model, none past the start for a large one). A drawn segment whose start was not kept is re-derived by
re-running the deterministic steps before it from the nearest kept boundary (``RoundTrace.answer``), so
the kept states cost host memory bounded by a budget, not one copy per segment on the accelerator,
and the prover pays compute only when an audit draws it: at the network's audit rate of 5%, a worker
keeping the start alone re-runs on average ``(S - 1) / 2 + 1`` of a round's S segments once in 20
rounds, about 2.8% of its compute at S = 8 (``bench/memory.py`` measures it).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import MAX_TRACE, Commitment
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.checkpoint import load_tensors, save_tensors
from gpuflex.train.optimizers import InnerOptimizer
from gpuflex.train.placement import host
from gpuflex.train.trainable import trainable

TRACE_HEX = 16  # trace hashes are sha256 truncated to 64 bits: a forgery still needs 2^64 tries
SEGMENTS = 8  # trace hashes per round by default (``VerificationSpec.trace_every``: None)

Params = dict[str, Tensor]


def trace_every(spec: TrainingSpec) -> int:
    """Inner steps between trace hashes: the spec's, or ``inner_steps / 8``; never more than 64 hashes."""
    every = spec.verification.trace_every or max(1, spec.inner_steps // SEGMENTS)
    return max(every, -(-spec.inner_steps // MAX_TRACE))


def device_class(device: torch.device, precision: str = "fp32", quantized: str | None = None) -> str:
    """The hardware class whose members reproduce each other's traces bit for bit: the device (a CPU's
    thread count), the inner steps' precision unless fp32, and a quantized base's kernels
    (``cpu/4t/bf16``, ``cuda:9.0/bf16/nf4``)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        own = f"cuda:{major}.{minor}"
    else:
        own = f"{device.type}/{torch.get_num_threads()}t"
    parts = [own] + ([precision] if precision != "fp32" else []) + ([quantized] if quantized else [])
    return "/".join(parts)


def params_hash(params: Params) -> str:
    """sha256 over the tensors' bytes in name order (a round's ``state_hash``)."""
    digest = hashlib.sha256()
    for name, t in sorted(params.items()):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().numpy())  # its buffer, not a copy
    return digest.hexdigest()


def training_state(model: nn.Module, optimizer: InnerOptimizer) -> Params:
    """Trainable parameters and their optimizer state (AdamW's moments, Muon's momentum) under one flat
    naming, ``<kind>.<parameter>``: what a trace hash covers."""
    state: Params = {}
    for name, p in trainable(model).items():
        state[f"p.{name}"] = p.detach()
        kept = optimizer.state.get(p, {})
        for key in optimizer.state_keys(p):
            if key in kept:
                state[f"{key}.{name}"] = torch.as_tensor(kept[key]).detach()  # an int step as a tensor
    return state


def load_state(model: nn.Module, optimizer: InnerOptimizer, state: Params) -> None:
    """Put ``state`` (``training_state``'s naming) into ``model`` and ``optimizer``: every parameter must
    be in it, and only the state the optimizer keeps for it (``optimizers.STATE_KEYS``); what it holds
    no state for starts afresh (a round's first step)."""
    named = trainable(model)
    for p in named.values():
        optimizer.state[p].clear()
    for key, tensor in state.items():
        kind, _, name = key.partition(".")
        if name not in named or kind not in ("p", *optimizer.state_keys(named[name])):
            raise BadRequest(f"unexpected tensor {key!r}")
        p = named[name]
        if kind not in ("step", *optimizer.block_state(p)) and tensor.shape != p.shape:
            raise BadRequest(f"{key} has shape {list(tensor.shape)}, expected {list(p.shape)}")
        if kind == "p":
            with torch.no_grad():
                p.copy_(tensor)
        else:
            optimizer.state[p][kind] = optimizer.restored(p, kind, tensor)
    missing = [n for n in named if f"p.{n}" not in state]
    if missing:
        raise BadRequest(f"parameters missing: {', '.join(missing[:4])}")


def trace_hash(model: nn.Module, optimizer: InnerOptimizer) -> str:
    return params_hash(training_state(model, optimizer))[:TRACE_HEX]


def batch_bytes(batch: tuple[Tensor, ...]) -> bytes:
    """What a batch contributes to the ``data`` hash: its tensors' bytes, so any recipe's batches hash."""
    return b"".join(t.detach().cpu().contiguous().numpy().tobytes() for t in batch)


def data_hash(batches: list[tuple[Tensor, ...]]) -> str:
    """The ``data`` a commitment names: sha256 over its batches' bytes, in order."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(batch_bytes(batch))
    return digest.hexdigest()


class _Deterministic:
    """``torch.use_deterministic_algorithms`` is process-wide: on while any thread trains or audits. It also
    fills every new uninitialized tensor (``torch.utils.deterministic.fill_uninitialized_memory``), a guard
    against reading one, which training never does and which cost a LoRA step 3% on a CPU: off meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.before = (False, True)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        flags = torch.utils.deterministic
        with self.lock:
            if self.holders == 0:
                self.before = (torch.are_deterministic_algorithms_enabled(), flags.fill_uninitialized_memory)
                torch.use_deterministic_algorithms(True)
                flags.fill_uninitialized_memory = False
            self.holders += 1
        try:
            yield
        finally:
            with self.lock:
                self.holders -= 1
                if self.holders == 0:
                    torch.use_deterministic_algorithms(self.before[0])
                    flags.fill_uninitialized_memory = self.before[1]


deterministic = _Deterministic()


@dataclass(frozen=True)
class Segment:
    """One trace segment as its worker saw it.

    The end state lets an auditor on another hardware class compare within a tolerance: it must hash
    to the committed trace entry, and the auditor's re-run must land near it."""

    step: int  # inner steps done before it
    start: Params  # ``training_state`` at its start (copied)
    end: Params  # ... and at its end
    lrs: list[float]  # the lr of each of its steps


def residual_hash(residual: Params) -> str:
    """``Commitment.residual``: the error-feedback residual a delta is compressed with, as the sender
    holds it just before compressing (``ErrorFeedback.residual``, tensor name -> fp32 tensor; ``{}``
    before the first compression), hashed like a trace entry. With the trace's last state it fixes the
    blob: ``compress(with_residual(start - last params, residual, decay))``. ``Commitment.residual_out``
    hashes what the sender holds just after."""
    return params_hash(residual)[:TRACE_HEX]


EMPTY_RESIDUAL = residual_hash({})  # a fresh worker's: any contribution may start a chain with it

_PARTS = ("final", "residual", "origin", "residual_out")


@dataclass(frozen=True)
class AuditState:
    """What a worker uploads when a contribution is drawn: the drawn segment (and, for a peer audit, the
    ones after it that the peer re-runs), and what binds its delta.

    ``final`` (the training state after the last step, hashing to ``trace[-1]``) and ``origin`` (the
    parameters the round started from, hashing to ``start``) are left out when the segments already hold
    them (the last segment ends in the final state, the first starts at the origin): ``final_state`` and
    ``origin_params`` fill them in. ``residual`` hashes to ``Commitment.residual``, ``residual_out`` to
    ``Commitment.residual_out`` (an auditor of another hardware class compares its own within a
    tolerance)."""

    segments: tuple[Segment, ...]  # consecutive
    residual: Params
    final: Params
    origin: Params
    residual_out: Params

    def segment(self, step: int) -> Segment | None:
        """The segment that starts after ``step`` inner steps, if this state holds it."""
        return next((seg for seg in self.segments if seg.step == step), None)

    def final_state(self) -> Params:
        return self.final or self.segments[-1].end

    def origin_params(self) -> Params:
        origin = self.origin or self.segments[0].start
        return {k.removeprefix("p."): v for k, v in origin.items() if k.startswith("p.")}

    def to_bytes(self) -> bytes:
        """Each boundary state once (a segment's end is the next one's start), then the binding parts."""
        boundaries = [self.segments[0].start, *(seg.end for seg in self.segments)]
        tensors = {f"state{i}/{k}": v for i, state in enumerate(boundaries) for k, v in state.items()}
        parts = (self.final, self.residual, self.origin, self.residual_out)
        tensors |= {
            f"{part}/{k}": v for part, state in zip(_PARTS, parts, strict=True) for k, v in state.items()
        }
        header = {"step": self.segments[0].step, "lrs": [seg.lrs for seg in self.segments]}
        return save_tensors(tensors, {"gpuflex-audit": json.dumps(header)})

    @staticmethod
    def from_bytes(data: bytes) -> AuditState:
        tensors, metadata = load_tensors(data)
        try:
            header = json.loads(metadata["gpuflex-audit"])
            step, lrs = int(header["step"]), [[float(x) for x in seg] for seg in header["lrs"]]
        except (KeyError, ValueError, TypeError) as err:
            raise BadRequest(f"not an audit state blob: {err}") from None
        if not lrs or len(lrs) > MAX_TRACE:
            raise BadRequest(f"an audit state blob holds 1 to {MAX_TRACE} segments, not {len(lrs)}")
        boundaries = [f"state{i}" for i in range(len(lrs) + 1)]
        parts: dict[str, Params] = {part: {} for part in (*boundaries, *_PARTS)}
        for key, tensor in tensors.items():
            part, _, name = key.partition("/")
            if part not in parts:
                raise BadRequest(f"audit state blob has an unexpected tensor {key!r}")
            parts[part][name] = tensor
        segments = []
        for i, seg_lrs in enumerate(lrs):
            segments.append(Segment(step, parts[boundaries[i]], parts[boundaries[i + 1]], seg_lrs))
            step += len(seg_lrs)
        final, residual, origin, residual_out = (parts[part] for part in _PARTS)
        return AuditState(tuple(segments), residual, final, origin, residual_out)


@dataclass(frozen=True)
class RoundTrace:
    """A round's trace as its worker keeps it to answer an audit: the states at the kept boundaries
    (boundary b follows ``b * every`` steps; boundary ``len(lrs)`` is the final state), each segment's
    learning rates, and ``rerun``, which re-derives the others: from the kept boundary b's state up to
    boundary e, the states at b + 1 .. e and the final state (the worker re-runs its steps in its own
    model and gives it back as it was)."""

    every: int
    lrs: tuple[list[float], ...]
    kept: dict[int, Params]
    rerun: Callable[[int, Params, int], tuple[list[Params], Params]] | None = None

    def answer(self, index: int, count: int, residual: Params, residual_out: Params) -> AuditState | None:
        """The state answering a draw of segment ``index``, with the ``count - 1`` segments after it (None:
        no such segment)."""
        segments = len(self.lrs)
        if not 0 <= index < segments:
            return None
        last = min(index + count, segments)
        states = {b: self.kept[b] for b in range(index, last + 1) if b in self.kept}
        missing = [b for b in range(index, last + 1) if b not in states and b != segments]
        final = self.kept.get(segments)
        if missing or final is None:  # the last boundary is the final state, which the worker's model holds
            assert self.rerun is not None, "a trace that did not keep every state re-runs the rest"
            base = max(b for b in self.kept if b <= (missing[0] if missing else index))
            rerun, live = self.rerun(base, self.kept[base], missing[-1] if missing else base)
            states |= {b: state for b, state in enumerate(rerun, start=base + 1) if b >= index}
            final = live if final is None else final
        states[segments] = final
        span = tuple(
            Segment(b * self.every, states[b], states[b + 1], self.lrs[b]) for b in range(index, last)
        )
        origin = {k: v for k, v in self.kept[0].items() if k.startswith("p.")} if index else {}
        return AuditState(span, residual, {} if last == segments else final, origin, residual_out)


class Tracer:
    """Builds one round's ``Commitment`` as the worker trains, and keeps the states an audit needs
    (``RoundTrace``): the start and every ``stride``-th boundary, in host memory. A kept state is copied
    (from a GPU, asynchronously into pinned memory) and hashed on a thread of its own while the next steps
    run; one not kept is hashed where it lies, tensor by tensor, so it needs no copy. ``seconds``: what the
    training thread spent on it (copying, hashing, waiting), verification's cost on the worker.

    ``full`` gives a kept state's tensors whole, one at a time (``DeviceGroup.full_tensors``). Over a
    replica's ranks every rank traces: on a sharded one each boundary's state is gathered by all of them,
    and rank 0's tracer alone gets it, so only its commitment and kept states mean anything (a follower's
    ``start`` is empty). A sharded replica keeps every boundary (``Replica.snapshot_stride``)."""

    def __init__(
        self,
        start: Params,
        seed: int,
        every: int,
        device: str,
        stride: int = 1,
        full: Callable[[Params], Iterable[tuple[str, Tensor]]] = dict.items,
    ):
        began = time.perf_counter()
        self.origin = start
        self.start = params_hash(start)
        self.seed = seed
        self.every = every
        self.device = device
        self.stride = stride
        self.full = full
        self.data = hashlib.sha256()
        self.hashes: list[Future[str]] = []
        self.kept: dict[int, Params] = {}  # boundary -> its state, in host memory
        self.lrs: list[list[float]] = []
        self.steps = 0
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuflex-trace")
        self.seconds = time.perf_counter() - began

    def before_step(self, model: nn.Module, optimizer: InnerOptimizer, batch: tuple[Tensor, ...]) -> None:
        began = time.perf_counter()
        if self.steps == 0:
            # the parameters are the round's start, held already; the optimizer's state is not
            moments = {k: v for k, v in training_state(model, optimizer).items() if not k.startswith("p.")}
            self.kept[0] = {f"p.{n}": p for n, p in self.origin.items()} | self._copy(moments)
        if self.steps % self.every == 0:
            self.lrs.append([])
        self.data.update(batch_bytes(batch))
        self.lrs[-1].append(optimizer.param_groups[0]["lr"])
        self.seconds += time.perf_counter() - began

    def after_step(self, model: nn.Module, optimizer: InnerOptimizer) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self._boundary(model, optimizer)

    def _boundary(self, model: nn.Module, optimizer: InnerOptimizer) -> None:
        """Hash the state: a kept one's copy on the hashing thread, any other here and now."""
        began = time.perf_counter()
        state = training_state(model, optimizer)
        boundary = len(self.hashes) + 1
        if boundary % self.stride == 0:
            copied = self.kept[boundary] = self._copy(state, non_blocking=True)
            ready = torch.cuda.Event() if torch.cuda.is_available() else None
            if ready is not None:
                ready.record()
            self.hashes.append(self._hasher.submit(_hash_when, copied, ready))
        else:
            done: Future[str] = Future()
            done.set_result(params_hash(state))
            self.hashes.append(done)
        self.seconds += time.perf_counter() - began

    def _copy(self, state: Params, *, non_blocking: bool = False) -> Params:
        """Host copies of ``state``'s tensors, whole."""
        return {k: host(v, non_blocking=non_blocking) for k, v in self.full(state)}

    def commit(
        self,
        model: nn.Module,
        optimizer: InnerOptimizer,
        rerun: Callable[[int, Params, int], tuple[list[Params], Params]] | None = None,
    ) -> tuple[Commitment, RoundTrace]:
        """The commitment once training stopped (the last, partial segment hashed too), and the trace
        (``rerun``: how its worker re-derives the states it did not keep)."""
        if self.steps % self.every:
            self._boundary(model, optimizer)
        began = time.perf_counter()
        trace = [h.result()[:TRACE_HEX] for h in self.hashes]
        self._hasher.shutdown()
        self.seconds += time.perf_counter() - began
        commitment = Commitment(
            seed=self.seed,
            start=self.start,
            data=self.data.hexdigest(),
            every=self.every,
            trace=trace,
            device=self.device,
        )
        return commitment, RoundTrace(self.every, tuple(self.lrs), self.kept, rerun)


def _hash_when(state: Params, ready: torch.cuda.Event | None) -> str:
    """``params_hash`` of host copies once their asynchronous copy from the device is done."""
    if ready is not None:
        ready.synchronize()
    return params_hash(state)
