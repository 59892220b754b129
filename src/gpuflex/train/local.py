"""A job on this machine, without the marketplace: the aggregator and every worker as a local process.

``run_local`` is what ``gpuflex train local`` and the benchmark run. The parent process hosts the
job's one ``LocalTransport`` and serves it to its children over an authenticated local socket
(``multiprocessing.connection``: one connection per child, one thread per connection on the
parent's side). The tasks are spawned processes, not threads, so their compute runs in parallel;
each calls ``run_aggregator`` or ``run_worker`` exactly as a provider's task subprocess does, with
``torch.set_num_threads(threads)``. A worker can be given a link (``throttle.Link``: its bandwidth
and latency, applied to all its traffic) and a slowdown (k: after each step it waits k - 1 times
the step's duration, as a k times slower device would take; asleep, or busy with ``spin``). Every
worker's traffic is metered at its end of the link, blobs and messages alike; only the dataset and
the recipe code, which each node holds already, are free. The aggregator plays a core node: its
link is not throttled::

    result = run_local(spec, corpus, workers=4, options=[WorkerOptions(link=Link(100e6, 0.05))] * 4)
    result.rounds[-1].val_loss, result.workers[0].link.bytes_total, result.workers[0].summary.utilization

A prepared dataset (``prepared=DIR``, what ``gpuflex data prepare`` wrote) is read from its directory by
every task, each opening only the shards it needs, as a provider's task would fetch them; which ones
each worker opened is in ``LocalWorker.shards``::

    result = run_local(spec, None, workers=4, prepared=Path("./prepared"))

A job whose spec has ``model.from`` gets its model directory as a network job does: bundled into the
job's blobs (``train.pretrained.bundle_model``), which every node holds already, so they are not metered.

The parent watches the rounds as they are published (``on_round``), collects every task's summary
and returns them with the rounds. If a task fails, the error is raised in the parent as the same
``GPUFlexError`` class (any other exception as ``ServiceError``), naming the task, with the child's
traceback as its cause; then, as on Ctrl-C or a timeout, every task is told to stop, given a few
seconds, then terminated: nothing outlives ``run_local``. Children ignore SIGINT (the parent
decides); "stop" is the parent's end of a pipe closing, so a child whose parent vanished stops too.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

import torch

from gpuflex.data.fetch import LocalShards
from gpuflex.data.fit import check_job
from gpuflex.data.manifest import MANIFEST, read_manifest
from gpuflex.errors import GPUFlexError, ServiceError
from gpuflex.protocol.messages import (
    AuditStateSubmit,
    ContributionList,
    ContributionReceipt,
    ContributionSubmit,
    PeerAuditAssign,
    PeerAuditList,
    PeerAuditReport,
    RoundPublish,
    RoundState,
    SecAggList,
    SecAggPost,
    TaskConfig,
    VerdictSubmit,
)
from gpuflex.protocol.spec import TrainingSpec, parse_job_spec
from gpuflex.train.aggregator import AggregatorSummary, run_aggregator
from gpuflex.train.throttle import Link, LinkStats, ThrottledTransport
from gpuflex.train.transport import LocalTransport, Transport
from gpuflex.train.worker import WorkerSummary, run_worker

LOCAL_PART_BYTES = 64 << 20  # model files are cut as the coordinator's default blob limit cuts them
STOP_GRACE_S = 10.0  # how long stopped tasks get to return before they are terminated
TRANSPORT_METHODS = frozenset(
    name for name in vars(Transport) if not name.startswith("_")
)  # all a child may call


@dataclass(frozen=True)
class WorkerOptions:
    """How one worker runs: its link to the job (None: unthrottled, still metered) and its slowdown."""

    link: Link | None = None
    slowdown: float = 1.0  # 3.0: three times slower than this machine makes it
    # Wait out the slowdown busy rather than asleep. Workers sharing too few cores should: a sleeping
    # worker hands its CPU share to the others, which a slow machine of its own would not.
    spin: bool = False

    def __post_init__(self) -> None:
        assert self.slowdown >= 1, f"slowdown must be at least 1, got {self.slowdown}"


@dataclass(frozen=True)
class RoundRecord:
    """One published round, as the parent saw it."""

    round: int
    seconds: float  # since run_local started, when the parent first saw the round published
    val_loss: float | None
    train_loss: float | None
    contributions: int
    tokens: int  # trained on in all rounds up to this one
    uploaded: int  # bytes of the contributions this round aggregated, all workers together
    update: int  # bytes of its aggregated update, which every worker downloads


@dataclass(frozen=True)
class LocalWorker:
    summary: WorkerSummary
    link: LinkStats  # what crossed this worker's link, both ways
    shards: list[str] = field(default_factory=list)  # a prepared dataset's shard files it opened


@dataclass
class LocalResult:
    rounds: list[RoundRecord]
    aggregator: AggregatorSummary
    workers: list[LocalWorker]
    logs: list[tuple[str, str]] = field(default_factory=list)  # (task id, message), in order
    checkpoint: bytes | None = None  # the last published full state (what `job fetch` downloads)
    spec: TrainingSpec | None = None  # the spec the tasks ran (with ``model.uploaded`` when it has one)


def slowdown_hook(
    factor: float, wait: Callable[[float], None] = time.sleep
) -> Callable[[float], None] | None:
    """A worker's ``after_step`` that makes it ``factor`` times slower (None when it need not be)."""
    if factor == 1:
        return None
    return lambda step_s: wait((factor - 1) * step_s)


def spin(seconds: float) -> None:
    """Wait ``seconds`` without giving up the CPU."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run_local(
    spec: TrainingSpec,
    dataset: bytes | None,
    workers: int,
    *,
    options: Sequence[WorkerOptions] | None = None,
    recipe_code: bytes | None = None,
    threads: int = 1,
    poll_interval_s: float = 0.05,
    on_round: Callable[[RoundRecord], None] | None = None,
    timeout_s: float | None = None,
    prepared: Path | None = None,
    secure_aggregation: int | None = None,
) -> LocalResult:
    """Train ``spec`` on ``dataset`` with ``workers`` worker processes and an aggregator process.

    ``options[i]`` is worker i's link and slowdown; ``recipe_code`` the file of a ``user`` recipe;
    ``threads`` the torch threads of each process; ``poll_interval_s`` how often tasks poll for rounds;
    ``on_round`` is called in this process with each round as it is published; ``prepared`` a prepared
    dataset's directory to train on instead of ``dataset``; ``secure_aggregation`` a threshold: the
    workers mask their updates as a federated job's owners (``secure.py``), each of equal weight. Raises
    the first task's failure, or ServiceError after ``timeout_s``; either way every process is gone.
    """
    options = list(options) if options is not None else [WorkerOptions()] * workers
    assert workers >= 1 and len(options) == workers, f"{workers} workers, {len(options)} options"
    hub = LocalTransport(
        spec.rounds, live_workers=workers, task_id="local", audit_rate=spec.verification.audit_rate
    )
    spec, model_blobs = _model_blobs(
        spec, hub
    )  # first: it counts the model's vocabulary, which data.fit reads
    if prepared is not None:
        dataset = _prepared_manifest(spec, workers, prepared)
    dataset_digest = hub.put_blob(dataset) if dataset is not None else None
    code_digest = hub.put_blob(recipe_code) if recipe_code is not None else None
    preloaded = frozenset(d for d in (dataset_digest, code_digest, *model_blobs) if d)
    launch = _Launch(threads, poll_interval_s, preloaded, prepared)
    inputs = {
        "workers": workers,
        "dataset": dataset_digest,
        "code": code_digest,
        "prepared": prepared is not None,
        "secure_aggregation": secure_aggregation,
    }
    configs = [_config(spec, "aggregator", 0, **inputs)]
    configs += [_config(spec, "worker", i, **inputs) for i in range(workers)]
    watcher = _RoundWatcher(hub, on_round)
    with _HubServer(hub) as server, _Children(server.address, server.authkey, launch) as children:
        for config, option in zip(configs, [WorkerOptions(), *options], strict=True):
            children.start(config, option)
        outcomes = children.collect(watcher.poll, timeout_s)
    watcher.poll()
    aggregator, *worker_outcomes = (outcomes[c.task_id] for c in configs)
    final = next((p.checkpoint for p in reversed(hub.history()) if p.checkpoint), None)
    return LocalResult(
        rounds=watcher.records,
        aggregator=aggregator.summary,
        workers=[LocalWorker(o.summary, o.link, o.shards) for o in worker_outcomes],
        logs=hub.logs(),
        checkpoint=hub.get_blob(final) if final else None,
        spec=spec,
    )


def _model_blobs(spec: TrainingSpec, hub: LocalTransport) -> tuple[TrainingSpec, list[str]]:
    """The job's model directory (``model.from``) into the hub as a network job's would be uploaded: the
    spec with ``model.uploaded`` set, and the blobs' keys."""
    if spec.model.from_ is None:
        return spec, []
    from gpuflex.train.pretrained import bundle_model  # transformers: only for a job that needs it

    spec, bundle, parts = bundle_model(Path(spec.model.from_), spec, LOCAL_PART_BYTES)
    return spec, [hub.put_blob(bundle.to_bytes()), *(hub.put_blob(part.read()) for part in parts)]


def _config(
    spec: TrainingSpec,
    role: str,
    index: int,
    *,
    workers: int,
    dataset: str | None,
    code: str | None,
    prepared: bool,
    secure_aggregation: int | None,
) -> TaskConfig:
    return TaskConfig(
        job_id="local",
        task_id=f"{role}-{index}",
        role=role,
        worker_index=index,
        num_workers=workers,
        training=spec,
        dataset=dataset,
        prepared=prepared,
        recipe_code=code,
        weights={f"worker-{i}": 1 for i in range(workers)} if secure_aggregation else None,
        secure_aggregation=secure_aggregation,
    )


def _prepared_manifest(spec: TrainingSpec, workers: int, directory: Path) -> bytes:
    """The manifest of the prepared dataset in ``directory``, once it fits the job as a job spec's would
    (``data.fit``): a refusal reads as ``gpuflex submit``'s."""
    job = parse_job_spec(
        {
            "name": "local",
            "resources": {"workers": workers},
            "training": spec.model_dump(mode="json"),
            "data": {"prepared": str(directory)},
        }
    )
    check_job(read_manifest(directory), job)
    return (directory / MANIFEST).read_bytes()


class _RoundWatcher:
    """Turns newly published rounds into ``RoundRecord`` s, timed when first seen."""

    def __init__(self, hub: LocalTransport, on_round: Callable[[RoundRecord], None] | None):
        self.hub = hub
        self.on_round = on_round
        self.began = time.monotonic()
        self.records: list[RoundRecord] = []

    def poll(self) -> None:
        for p in self.hub.history()[len(self.records) :]:
            uploaded = 0
            if p.round > 0:
                uploaded = sum(
                    len(self.hub.get_blob(c.delta)) for c in self.hub.contributions(p.round - 1).contributions
                )
            record = RoundRecord(
                round=p.round,
                seconds=time.monotonic() - self.began,
                val_loss=p.val_loss,
                train_loss=p.train_loss,
                contributions=p.contributions,
                tokens=p.tokens,
                uploaded=uploaded,
                update=len(self.hub.get_blob(p.update)) if p.update else 0,
            )
            self.records.append(record)
            if self.on_round is not None:
                self.on_round(record)


# -- the parent's side of the socket -----------------------------------------------------------


class _HubServer:
    """Serves ``hub`` to the children: each connection names its task once, then sends calls."""

    def __init__(self, hub: LocalTransport):
        self.hub = hub
        self.authkey = secrets.token_bytes(32)
        self.listener = Listener(family="AF_UNIX", authkey=self.authkey)
        self.address = self.listener.address
        self.closing = False
        self.accepter = threading.Thread(target=self._accept, name="hub-accept", daemon=True)

    def __enter__(self) -> _HubServer:
        self.accepter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            Client(self.address, authkey=self.authkey).close()  # wakes the accepter up to see `closing`
        self.accepter.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.closing:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError):
                continue
            threading.Thread(target=self._serve, args=(conn,), name="hub-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                view = self.hub.for_task(conn.recv())
                while True:
                    method, args = conn.recv()
                    conn.send(_call(view, method, args))
            except (EOFError, OSError):  # the child is gone
                return


def _call(view: LocalTransport, method: str, args: tuple) -> tuple[bool, Any]:
    """(True, what ``view.method(*args)`` returned) or (False, the error it raised, as a GPUFlexError)."""
    if method not in TRANSPORT_METHODS:
        return False, ServiceError(f"{method!r} is not a transport call")
    try:
        return True, getattr(view, method)(*args)
    except GPUFlexError as err:
        return False, err
    except Exception as err:  # a bug here must reach the child as an error, not as a dropped connection
        return False, ServiceError(f"{method} failed in the parent: {type(err).__name__}: {err}")


# -- the children's side -----------------------------------------------------------------------


class _HubClient:
    """A child's ``Transport``: every call goes over its connection to the parent's hub."""

    def __init__(self, address: str, authkey: bytes, task_id: str):
        self._conn = Client(address, authkey=authkey)
        self._conn.send(task_id)
        self._lock = threading.Lock()  # a worker calls from its loop and its exchange thread

    def _call(self, method: str, *args: object) -> Any:
        try:
            with self._lock:
                self._conn.send((method, args))
                ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise ServiceError("lost the connection to the job's parent process") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._conn.close()

    def get_blob(self, digest: str) -> bytes:
        return self._call("get_blob", digest)

    def put_blob(self, data: bytes) -> str:
        return self._call("put_blob", data)

    def latest_round(self) -> RoundState | None:
        return self._call("latest_round")

    def round_state(self, round: int) -> RoundState:
        return self._call("round_state", round)

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        return self._call("submit_contribution", c)

    def submit_audit_state(self, a: AuditStateSubmit) -> None:
        self._call("submit_audit_state", a)

    def report_verdict(self, v: VerdictSubmit) -> None:
        self._call("report_verdict", v)

    def assign_peer_audit(self, a: PeerAuditAssign) -> None:
        self._call("assign_peer_audit", a)

    def peer_audits(self, round: int | None = None) -> PeerAuditList:
        return self._call("peer_audits", round)

    def report_peer_audit(self, r: PeerAuditReport) -> None:
        self._call("report_peer_audit", r)

    def post_secagg(self, p: SecAggPost) -> None:
        self._call("post_secagg", p)

    def secagg_messages(self, round: int, after: int = -1) -> SecAggList:
        return self._call("secagg_messages", round, after)

    def contributions(self, round: int) -> ContributionList:
        return self._call("contributions", round)

    def publish_round(self, p: RoundPublish) -> None:
        self._call("publish_round", p)

    def log(self, message: str) -> None:
        self._call("log", message)


@dataclass(frozen=True)
class _Launch:
    """What every child is started with besides its own config and options."""

    threads: int
    poll_interval_s: float
    preloaded: frozenset[str]  # blobs every node holds already (the dataset, the recipe code)
    prepared: Path | None = None  # a prepared dataset's directory, which every task reads its shards from


@dataclass(frozen=True)
class _Outcome:
    task_id: str
    summary: Any = None  # WorkerSummary | AggregatorSummary
    link: LinkStats | None = None
    shards: list[str] = field(default_factory=list)
    error: GPUFlexError | None = None
    traceback: str = ""


def _child_main(
    config: TaskConfig,
    option: WorkerOptions,
    address: str,
    authkey: bytes,
    launch: _Launch,
    stop: Connection,  # readable (at EOF) once the parent wants the task to stop, or is gone
    results: Connection,
) -> None:
    """A task process: run the task over the parent's hub and send back its outcome."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (commitment.py)
    torch.set_num_threads(launch.threads)
    try:
        hub = _HubClient(address, authkey, config.task_id)
        transport = ThrottledTransport(hub, option.link or Link(), preloaded=launch.preloaded)
        reader = LocalShards(launch.prepared) if launch.prepared is not None else None
        common: dict[str, Any] = {
            "poll_interval_s": launch.poll_interval_s,
            "should_stop": stop.poll,
            "reader": reader,
        }
        if config.role == "aggregator":
            summary: Any = run_aggregator(config, transport, **common)
        else:
            summary = run_worker(
                config,
                transport,
                after_step=slowdown_hook(option.slowdown, spin if option.spin else time.sleep),
                **common,
            )
        outcome = _Outcome(config.task_id, summary, transport.stats(), reader.opened if reader else [])
        hub.close()
    except BaseException as err:  # whatever it was, the parent must hear of it
        known = err if isinstance(err, GPUFlexError) else ServiceError(f"{type(err).__name__}: {err}")
        outcome = _Outcome(config.task_id, error=known, traceback=traceback.format_exc())
    results.send(outcome)
    results.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown, seconds with torch loaded: all there was to say is sent


class _RemoteTraceback(Exception):
    """A child's traceback, as the cause of the error the parent raises (as concurrent.futures does)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def orphaned(outcomes: dict[str, _Outcome], workers: set[str], tasks: int) -> str | None:
    """Why the job cannot finish, once every worker has ended without seeing it finish while a task
    (the aggregator) still runs: nobody is left to contribute to its round. None while it can."""
    if len(outcomes) == tasks or any(w not in outcomes or outcomes[w].summary.finished for w in workers):
        return None
    last = ", ".join(
        f"{w} round {max(outcomes[w].summary.contributed, default='-')}" for w in sorted(workers)
    )
    return (
        f"every worker stopped before the job's last round (last accepted contributions: {last}), so "
        "nobody is left to contribute; the job's log says why (a guilty verdict ends a worker's part)"
    )


class _Children:
    """The task processes: started, collected, and on the way out stopped, then terminated if need be."""

    def __init__(self, address: str, authkey: bytes, launch: _Launch):
        self.context = multiprocessing.get_context("spawn")  # no fork: the parent runs threads
        self.address, self.authkey, self.launch = address, authkey, launch
        self.stop, self.stop_writer = self.context.Pipe(duplex=False)  # closing the writer says "stop"
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.results: dict[Connection, str] = {}
        self.workers: set[str] = set()

    def __enter__(self) -> _Children:
        return self

    def start(self, config: TaskConfig, option: WorkerOptions) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        args = (config, option, self.address, self.authkey, self.launch, self.stop, writer)
        process = self.context.Process(target=_child_main, args=args, name=config.task_id, daemon=True)
        process.start()
        writer.close()  # the child holds the only writer: its exit shows as EOF here
        self.processes[config.task_id] = process
        self.results[reader] = config.task_id
        if config.role == "worker":
            self.workers.add(config.task_id)

    def collect(self, tick: Callable[[], None], timeout_s: float | None) -> dict[str, _Outcome]:
        """Every task's outcome; raises the first failure, or ServiceError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outcomes: dict[str, _Outcome] = {}
        while len(outcomes) < len(self.processes):
            for reader in wait([r for r, task in self.results.items() if task not in outcomes], timeout=0.2):
                outcome = self._receive(reader)
                outcomes[outcome.task_id] = outcome
            tick()
            if (why := orphaned(outcomes, self.workers, len(self.processes))) is not None:
                raise ServiceError(why)
            if deadline is not None and time.monotonic() > deadline:
                raise ServiceError(f"the job did not finish within {timeout_s:g}s")
        return outcomes

    def _receive(self, reader: Connection) -> _Outcome:
        task_id = self.results[reader]
        try:
            outcome: _Outcome = reader.recv()
        except (EOFError, OSError):
            process = self.processes[task_id]
            process.join(timeout=5)
            raise ServiceError(f"{task_id} exited (code {process.exitcode}) without a result") from None
        if outcome.error is not None:
            err = type(outcome.error)(f"{task_id} failed: {outcome.error.message}")
            raise err from _RemoteTraceback(outcome.traceback)
        return outcome

    def __exit__(self, *exc: object) -> None:
        self.stop_writer.close()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
        for reader in [self.stop, *self.results]:
            reader.close()
