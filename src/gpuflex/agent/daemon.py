"""The agent daemon: a set of periodic duties around at most one running task.

    register -> loop { heartbeat (renew leases, learn revocations); lease when idle; watch the task }

An encrypted job's task (``privacy.encrypt``) starts at once and waits for its data key: the watch
asks the coordinator for the key sealed to this node's X25519 key for the lease (every ``KEY_POLL_S``,
heartbeats keeping the lease), opens it and writes it into the task's directory.

The heartbeat runs in its own thread so a slow lease call never starves it. One failing duty is
logged and retried; the daemon lives on (a coordinator restart is an outage, not a crash). On
SIGTERM it hands its task back (so the market re-leases it at once), says goodbye and exits.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuflex.agent.benchmark import run_benchmark
from gpuflex.agent.hardware import probe_hardware
from gpuflex.agent.private import announce
from gpuflex.agent.runner import DATA_KEY
from gpuflex.agent.sandbox import Limits, TaskProcess, start_task
from gpuflex.auth import sealing
from gpuflex.auth.signing import NodeKey, sign_sealing_key
from gpuflex.client import NodeClient
from gpuflex.data.cache import ShardCache
from gpuflex.errors import BadRequest, GPUFlexError
from gpuflex.privacy.envelope import public_bytes, unseal_key
from gpuflex.protocol import messages as m

log = logging.getLogger("gpuflex.agent")
KEY_POLL_S = 1.0  # how often a task waiting for its data key has the coordinator asked

AUDIT_POLL_S = 2.0  # how often a node that may audit asks for served requests to re-check
SERVING_PREFIX = "serve-"  # the kinds of gpuflex.serve.cheats.SERVING: a server task plays them, a worker not


@dataclass(frozen=True)
class AgentConfig:
    coordinator_url: str
    name: str
    data_dir: Path
    price_per_hour: float
    kind: m.NodeKind = "community"
    ca: str | None = None  # the CA that signed an HTTPS coordinator's certificate; None: the system's
    core_token: str | None = None
    region: str = "local"
    available_hours: float | None = None  # on offer for this long from the agent's start; None: open-ended
    task_threads: int = 0  # 0: torch's default (every core); the local network uses 1 per task
    emulate_step_s: float = 0.0  # > 0: pad each inner step to this long (one machine posing as many)
    lease_poll_s: float = 30.0  # idle, ask for work this often even unasked; a heartbeat says when to ask
    benchmark_s: float = 1.5
    cache_gb: float = 20.0  # the shard cache (data_dir/cache) that tasks share: shards and model files
    limits: Limits = field(default_factory=Limits)
    # private datasets offered to federated jobs, by name (``agent.private``), and the accounts admitted
    private_data: dict[str, Path] = field(default_factory=dict)
    consumers: tuple[str, ...] = ()
    # TESTING ONLY: every worker task plays this gpuflex.train.adversaries kind, or every server task this
    # gpuflex.serve.cheats.SERVING kind (a cheating provider, for `gpuflex demo --cheater` and tests of
    # verification). None: an honest provider.
    adversary: str | None = None


@dataclass
class RunningTask:
    grant: m.LeaseGrant
    process: TaskProcess
    workdir: Path
    keyed: bool  # has its data key, or needs none
    next_key_ask: float = 0.0  # time.monotonic()


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.limits = config.limits
        self.private_data = announce(config.private_data)  # first: a bad DIR stops the agent here
        self.key = NodeKey.load_or_create(config.data_dir / "node.key")
        self.sealing_key = sealing.load_or_create(config.data_dir / "sealing.key")
        self.client = NodeClient(config.coordinator_url, self.key, ca=config.ca)
        self.stopping = threading.Event()
        self.heartbeat_interval_s = 2.0
        self.task: RunningTask | None = None  # owned by the main loop; the heartbeat thread only reads it
        self.revoked: set[str] = set()  # leases the coordinator told us to stop, filled by heartbeats
        # set when a heartbeat says a task is placed on us (and at the start): the lease loop asks then,
        # rather than every idle agent polling the coordinator for work
        self.work = threading.Event()
        self.work.set()
        # Tasks read and write the cache themselves (Landlock lets them: ``start_task``'s ``shared``): they
        # fetch only the shards they turn out to need (an auditor's) and their model's files, and check every
        # one's hash on use.
        self.cache = ShardCache(config.data_dir / "cache", max(1, int(config.cache_gb * 2**30)))
        hours = config.available_hours
        self.available_until = None if hours is None else time.time() + hours * 3600

    def register(self) -> m.NodeRegistered:
        """Probe, benchmark and register; retried until the coordinator answers or we are stopped."""
        hardware = probe_hardware()
        if hardware.device == "cuda" and self.limits.memory_mb is not None:
            log.info("GPU present: tasks get no address-space limit (the CUDA driver reserves tens of GB)")
            self.limits = replace(self.limits, memory_mb=None)
        bench = run_benchmark(hardware.device, self.config.benchmark_s, self.config.task_threads)
        sealing_hex = public_bytes(self.sealing_key).hex()
        msg = m.NodeRegister(
            name=self.config.name,
            public_key=self.key.public_key_hex,
            kind=self.config.kind,
            core_token=self.config.core_token,
            hardware=hardware,
            benchmark=bench,
            price_per_hour=self.config.price_per_hour,
            region=self.config.region,
            private_data=self.private_data,
            consumers=list(self.config.consumers),
            sealing_key=sealing_hex,
            sealing_key_signature=sign_sealing_key(self.key, sealing_hex),
        )
        while True:
            try:
                # counted from the agent's start: time spent retrying is not added to the offer
                left = None if self.available_until is None else max(0.0, self.available_until - time.time())
                msg.available_hours = None if left is None else left / 3600
                registered = self.client.register(msg)
                break
            except GPUFlexError as err:
                if err.status_code < 500 or self.stopping.wait(2.0):
                    raise
                log.warning("register: %s; retrying", err.message)
        self.heartbeat_interval_s = registered.heartbeat_interval_s
        log.info(
            "registered %s as %s (%s, %.3f TFLOPS)",
            self.config.name,
            registered.node_id,
            self.config.kind,
            bench.tflops_fp32,
        )
        return registered

    def run(self) -> None:
        self.register()
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        audits = threading.Thread(target=self._audit_loop, name="inference-audits", daemon=True)
        audits.start()
        while not self.stopping.is_set():
            self._duty("watch task", self._watch_task)
            if self.task is None and not self.stopping.is_set():
                self.work.clear()
                self._duty("lease", self._lease)
            if self.task is None:
                self.work.wait(self.config.lease_poll_s)
            else:
                self.stopping.wait(0.5)
        self._drain()
        beat.join(timeout=5)
        audits.join(timeout=5)

    def stop(self, *_: object) -> None:
        self.stopping.set()
        self.work.set()  # wakes the lease loop

    def _duty(self, name: str, fn) -> None:
        try:
            fn()
        except GPUFlexError as err:
            log.warning("%s: %s", name, err.message)
        except Exception:
            log.exception("%s failed; retrying next pass", name)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_interval_s):
            self._duty("heartbeat", self._heartbeat)

    def _audit_loop(self) -> None:
        """Re-check served requests of deployments (``agent.auditor``): a core node always; a community
        node while it serves a replica (the coordinator hands it audits only while no core node is online).
        The auditor is made on first use: a node that never audits never loads torch for it."""
        auditor = None
        while not self.stopping.wait(AUDIT_POLL_S):
            task = self.task
            if self.config.kind != "core" and (task is None or task.grant.role != "server"):
                continue
            if auditor is None:
                from gpuflex.agent.auditor import InferenceAuditor

                auditor = InferenceAuditor(self.client, self.cache, self.config.task_threads)
            self._duty("inference audits", auditor.run_once)

    def _heartbeat(self) -> None:
        task = self.task
        held = [m.LeaseHeld(lease_id=task.grant.lease_id, epoch=task.grant.epoch)] if task else []
        ack = self.client.heartbeat(held)
        self.heartbeat_interval_s = ack.heartbeat_interval_s
        self.revoked.update(ack.revoked)
        if ack.work:
            self.work.set()

    def _task_config(self, grant: m.LeaseGrant) -> m.TaskConfig | m.ServerConfig:
        """The task as leased; a worker or a server of a (testing-only) cheating agent plays its adversary
        (a serving kind for a server, a training kind for a worker)."""
        adversary, task = self.config.adversary, grant.task
        if adversary is None or task.role not in ("worker", "server"):
            return task
        if (task.role == "server") != adversary.startswith(SERVING_PREFIX):
            return task
        log.warning("TESTING ONLY: %s task %s plays adversary %r", task.role, grant.task_id, adversary)
        return task.model_copy(update={"adversary": adversary})

    def _lease(self) -> None:
        grant = self.client.lease()
        if grant is None:
            return
        workdir = self.config.data_dir / "tasks" / grant.lease_id
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "task.json").write_text(self._task_config(grant).model_dump_json())
        trust = {}
        if self.config.ca:  # the task is confined to its directory: it gets its own copy to read
            shutil.copyfile(self.config.ca, workdir / "ca.pem")
            trust = {"GPUFLEX_CA": str(workdir / "ca.pem")}
        private = self._private_dir(grant)
        if private is not None:
            trust["GPUFLEX_PRIVATE_DATA"] = str(private)
        process = start_task(
            [sys.executable, "-m", "gpuflex.agent.runner", "task.json"],
            workdir=workdir,
            env_extra={
                "GPUFLEX_COORDINATOR_URL": self.config.coordinator_url,
                "GPUFLEX_TASK_TOKEN": grant.task_token,
                "GPUFLEX_TASK_THREADS": str(self.config.task_threads),
                "GPUFLEX_TASK_MIN_STEP_S": str(self.config.emulate_step_s),
                "GPUFLEX_SHARD_CACHE": str(self.cache.root),
                "GPUFLEX_SHARD_CACHE_BYTES": str(self.cache.limit_bytes),
                **trust,
            },
            limits=self.limits,
            log_path=workdir / "task.log",
            shared=[self.cache.root],
            read_only=[private] if private is not None else [],
        )
        encrypted = isinstance(grant.task, m.TaskConfig) and grant.task.encrypted
        self.task = RunningTask(grant, process, workdir, keyed=not encrypted)
        log.info("leased %s task %s of %s (epoch %d)", grant.role, grant.task_id, grant.job_id, grant.epoch)

    def _private_dir(self, grant: m.LeaseGrant) -> Path | None:
        """The private dataset a federated worker reads here (read-only); None for any other task, or one
        for a dataset this node does not offer (the task then fails saying so)."""
        task = grant.task
        if not isinstance(task, m.TaskConfig) or task.role != "worker" or task.federated is None:
            return None
        return self.config.private_data.get(task.federated)

    def _watch_task(self) -> None:
        """Report a task that ended; stop one whose lease the coordinator revoked (no report due)."""
        task = self.task
        if task is None:
            return
        if task.grant.lease_id in self.revoked:
            log.info("lease %s was revoked; stopping its task", task.grant.lease_id)
            task.process.terminate(grace_s=5)
            self.task = None
            return
        code = task.process.poll()
        if code is None:
            if not task.keyed:
                self._deliver_key(task)
            return
        outcome = "completed" if code == 0 else "failed"
        detail = "" if code == 0 else f"exit code {code}: {task.process.tail(1500)}"
        log.info("task of lease %s ended: %s", task.grant.lease_id, outcome)
        self.task = None
        self._report(task.grant, outcome, detail)

    def _deliver_key(self, task: RunningTask) -> None:
        """Hand the task its job's data key once the consumer sealed it to this node; a key that does not
        open here fails the task, saying so."""
        if time.monotonic() < task.next_key_ask:
            return
        task.next_key_ask = time.monotonic() + KEY_POLL_S
        answer = self.client.lease_key(task.grant.lease_id, task.grant.epoch)
        if answer.sealed_key is None:
            return
        try:
            data_key = unseal_key(bytes.fromhex(answer.sealed_key), self.sealing_key, task.grant.job_id)
        except BadRequest as err:
            log.warning("lease %s: %s", task.grant.lease_id, err.message)
            task.process.terminate(grace_s=5)
            self.task = None
            self._report(task.grant, "failed", f"the job's data key cannot be unsealed here: {err.message}")
            return
        temp = task.workdir / f".{DATA_KEY}"  # the directory is the task's own, mode 0700
        temp.write_bytes(data_key)
        temp.replace(task.workdir / DATA_KEY)
        task.keyed = True
        log.info("lease %s: the job's data key handed to its task", task.grant.lease_id)

    def _report(self, grant: m.LeaseGrant, outcome: m.LeaseOutcome, detail: str) -> None:
        try:
            self.client.report(
                grant.lease_id, m.LeaseReport(epoch=grant.epoch, outcome=outcome, detail=detail)
            )
        except GPUFlexError as err:
            log.warning("report of lease %s: %s", grant.lease_id, err.message)

    def _drain(self) -> None:
        """Hand back a running task, say goodbye, and leave nothing running."""
        task, self.task = self.task, None
        if task is not None:
            task.process.terminate(grace_s=5)
            self._report(task.grant, "released", "the provider is shutting down")
        self._duty("leave", self.client.leave)
        self.client.close()
        log.info("left the network")
