"""Goodput under faults: one 8-worker job on a local network, undisturbed, with workers killed, and with
the coordinator killed.

    python bench/goodput.py            # the reported mode: 24 rounds of 4 s
    python bench/goodput.py --quick    # 12 rounds of 3 s: under 5 minutes
    python bench/goodput.py --seed 7   # another fault schedule

Every run is a real network on loopback: a coordinator (SQLite), 2 core agents (the aggregator and a
spare) and 10 community agents (8 workers and 2 idle spares, as a market has), all processes. Each
agent emulates a device that takes ``STEP_S`` per inner step (``provider start --emulate-step-s``), so
one 2-core machine can pose as 12 without the workers competing for its cores: killing a worker must
not make the others faster. Rounds are time-budgeted (``round_seconds``), as a job on unequal,
unreliable nodes runs.

1. ``clean``: the job undisturbed.
2. ``faults``: the same job; 25% of the workers (2 of 8) are killed with ``kill -9`` (agent and task) at
   seeded random moments, and a replacement node joins the market after each kill.
3. ``coordinator``: the same job; the coordinator is killed with ``kill -9`` once and started again.

Measured, from the coordinator's job events and database:

- ``loss_gap``: (final val loss with faults − without) / without.
- ``goodput_retained``: tokens in published rounds per second of the job (round 0 to the last round),
  with faults over without.
- ``time_overhead``: the job's wall time with faults over without, minus 1.
- ``lost_rounds``: rounds whose accepted work vanished: fewer contributions aggregated than accepted.
- ``detect_to_release_s``: median time from a node being declared lost to its task's new lease.
- ``rejoin_rounds``: median rounds from a replacement's lease to its first accepted contribution
  (0: it contributed to the round open when it joined).
- ``death_to_release_s``: median time from the kill to the task's new lease (detection included).
- ``death_to_running_s``: median time from the kill to the replacement's task running: it has loaded
  the data and the global model and begins to train (its ``joined at round`` event).
- ``coordinator_kill_rounds``: what the coordinator kill cost the job, in rounds: the wall time it would
  have taken at the undisturbed run's goodput to train the tokens the run missed, plus any extra wall
  time. Rounds are time-budgeted, so an outage shows as fewer tokens more than as a longer job.

It writes ``bench/results/goodput[-quick][-seedN].json`` (every run and fault) and prints one JSON
object as its last line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from gpuflex.cli.inputs import upload_inputs
from gpuflex.client import Client
from gpuflex.coordinator.db import Contribution, make_engine, make_sessionmaker
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.messages import JobDetail, JobEvent
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import wait_for

WORKERS = 8
SPARES = 2  # idle community nodes on the market
KILLED = WORKERS // 4
STEP_S = 0.1  # every agent emulates a device doing one inner step per 0.1 s
HEARTBEAT_S = 1.0
LIVENESS = {
    "GPUFLEX_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
    "GPUFLEX_HEARTBEAT_MISSES": "3",
    "GPUFLEX_LEASE_TTL_S": "10",
}
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Mode:
    rounds: int
    round_seconds: float


DEFAULT = Mode(rounds=24, round_seconds=4.0)
QUICK = Mode(rounds=12, round_seconds=3.0)


def job_spec(mode: Mode, seed: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "goodput",
            "resources": {"workers": WORKERS},
            "training": {
                "rounds": mode.rounds,
                "inner_steps": 10_000,  # the time budget decides
                "round_seconds": mode.round_seconds,
                "round_timeout_s": 60,
                "batch_size": 16,
                "lr": 3e-3,
                "seed": seed,
                "compression": "int8",
                "eval_batches": 16,
                "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
            },
            "data": {"source": "stdlib", "max_bytes": 1_000_000},
            "budget": 100.0,
            "max_price_per_hour": 1.0,
        }
    )


@dataclass
class Fault:
    kind: str  # worker | coordinator
    at: float  # unix time of the kill
    node_id: str | None = None
    detected_at: float | None = None
    released_at: float | None = None
    replacement: str | None = None
    running_at: float | None = None
    rejoin_rounds: int | None = None


@dataclass
class Run:
    name: str
    val_loss: float
    initial_val_loss: float
    tokens: int
    wall_s: float
    rounds: int
    lost_rounds: int
    faults: list[Fault] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.tokens / self.wall_s


class Network:
    """One run's network: coordinator, core and community agents, and our consumer."""

    def __init__(self, root: Path):
        self.net = LocalNetwork(root, settings=LIVENESS)
        self.joined = 0
        url = self.net.start_coordinator()
        for i in range(2):
            self.net.start_agent(f"core{i}", price=0.4, core=True, extra=self._agent_flags(core=True))
        for _ in range(WORKERS + SPARES):
            self.add_community()
        self.client = Client(url, Client(url).create_account("bench").token, retry_for_s=60)
        self.client.deposit(100)
        wait_for(lambda: self._online() == 2 + WORKERS + SPARES, 120, "the agents to register")

    @staticmethod
    def _agent_flags(*, core: bool = False) -> list[str]:
        return ["--emulate-step-s", str(STEP_S), *(["--core-token", CORE_TOKEN] if core else [])]

    def add_community(self) -> None:
        self.net.start_agent(f"c{self.joined}", price=0.1, extra=self._agent_flags())
        self.joined += 1

    def _online(self) -> int:
        return sum(o.state == "online" for o in self.client.offers())

    def names(self) -> dict[str, str]:
        return {o.node_id: o.name for o in self.client.offers()}


def run(name: str, mode: Mode, seed: int, root: Path, strikes: list[tuple[float, str]]) -> Run:
    """Run the job; ``strikes`` are (seconds after round 0, worker | coordinator) kills."""
    rng = random.Random(f"{seed}:{name}")
    network = Network(root)
    try:
        client = network.client
        spec = job_spec(mode, seed)
        job_id = client.submit(spec, **upload_inputs(client, spec)).id
        started = wait_for(lambda: client.job(job_id).rounds_log, 300, "round 0")[0].published_at.timestamp()
        faults = [_strike(network, job_id, started + delay, kind, rng) for delay, kind in strikes]
        job = wait_for(lambda: (j := client.job(job_id)).state == "completed" and j, 600, "the job to end")
        events = client.logs(job_id)
        for fault in faults:
            _trace(fault, job, events)
        return Run(
            name=name,
            val_loss=job.val_loss,
            initial_val_loss=job.initial_val_loss,
            tokens=job.rounds_log[-1].tokens,
            wall_s=job.rounds_log[-1].published_at.timestamp() - started,
            rounds=job.round,
            lost_rounds=_lost_rounds(network.net.database, job),
            faults=faults,
        )
    finally:
        network.net.stop()


def _strike(network: Network, job_id: str, at: float, kind: str, rng: random.Random) -> Fault:
    time.sleep(max(0.0, at - time.time()))
    if kind == "coordinator":
        fault = Fault(kind, time.time())
        network.net.restart_coordinator(signal.SIGKILL, down_s=1.0)
        return fault
    names = network.names()
    held = sorted(
        t.node_id for t in network.client.job(job_id).tasks if t.role == "worker" and t.state == "leased"
    )
    victim = rng.choice(held)
    fault = Fault(kind, time.time(), node_id=victim)
    network.net.kill_agent(names[victim])
    network.add_community()  # a replacement joins the market
    print(f"  killed {names[victim]} ({victim})", file=sys.stderr)
    return fault


def _trace(fault: Fault, job: JobDetail, events: list[JobEvent]) -> None:
    """When the victim was declared lost, when its task was leased again, when the successor contributed."""
    if fault.kind != "worker":
        return
    log = [(e.at.timestamp(), e.message) for e in events]
    lost = re.compile(rf"^worker (\d+) on {fault.node_id} lost")
    detected = next(((at, m) for at, msg in log if at >= fault.at and (m := lost.match(msg))), None)
    if detected is None:
        return
    fault.detected_at = detected[0]
    leased = re.compile(rf"^worker {detected[1].group(1)} leased to \S+ \((\S+)\), epoch")
    grant = next(((at, m) for at, msg in log if at >= fault.detected_at and (m := leased.match(msg))), None)
    if grant is None:
        return
    fault.released_at, fault.replacement = grant[0], grant[1].group(1)
    joined = f"[{fault.replacement}] joined at round "
    fault.running_at = next(
        (at for at, msg in log if at >= fault.released_at and msg.startswith(joined)), None
    )
    published = [(r.published_at.timestamp(), r.round) for r in job.rounds_log]
    open_round = max(r for at, r in published if at <= fault.released_at)
    contributed = re.compile(rf"^\[{fault.replacement}\] round (\d+): .* accepted$")
    first = next((int(m.group(1)) for _, msg in log if (m := contributed.match(msg))), None)
    fault.rejoin_rounds = None if first is None else first - open_round


def _lost_rounds(database: str, job: JobDetail) -> int:
    """Rounds that aggregated fewer contributions than were accepted for them: accepted work vanished."""
    engine = make_engine(database)
    try:
        with make_sessionmaker(engine)() as s:
            accepted = dict(
                s.execute(
                    select(Contribution.round, func.count(Contribution.id))
                    .where(Contribution.job_id == job.id)
                    .group_by(Contribution.round)
                ).all()
            )
    finally:
        engine.dispose()
    used = {r.round - 1: r.contributions for r in job.rounds_log if r.round > 0}
    return sum(accepted.get(r, 0) > n for r, n in used.items())


def _median(values: list[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(clean: Run, faulty: Run, coordinator: Run) -> dict:
    workers = [f for f in faulty.faults if f.kind == "worker"]
    round_s = clean.wall_s / clean.rounds
    return {
        "loss_gap": round((faulty.val_loss - clean.val_loss) / clean.val_loss, 4),
        "goodput_retained": round(faulty.goodput / clean.goodput, 4),
        "time_overhead": round(faulty.wall_s / clean.wall_s - 1, 4),
        "lost_rounds": faulty.lost_rounds,
        "detect_to_release_s": _round(_median([_gap(f.detected_at, f.released_at) for f in workers])),
        "rejoin_rounds": _median([f.rejoin_rounds for f in workers]),
        "death_to_release_s": _round(_median([_gap(f.at, f.released_at) for f in workers])),
        "death_to_running_s": _round(_median([_gap(f.at, f.running_at) for f in workers])),
        "coordinator_kill_rounds": round(
            (coordinator.wall_s - coordinator.tokens / clean.goodput) / round_s, 2
        ),
        "coordinator_lost_rounds": coordinator.lost_rounds,
        "heartbeat_interval_s": HEARTBEAT_S,
    }


def _gap(since: float | None, until: float | None) -> float | None:
    return None if since is None or until is None else until - since


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 rounds of 3 s instead of 24 of 4 s")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed and the fault schedule's")
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else DEFAULT
    rng = random.Random(args.seed)
    duration = mode.rounds * mode.round_seconds
    worker_kills = sorted(rng.uniform(0.1, 0.7) * duration for _ in range(KILLED))
    coordinator_kill = rng.uniform(0.2, 0.6) * duration
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gpuflex-goodput-") as tmp:
        for name, strikes in (
            ("clean", []),
            ("faults", [(t, "worker") for t in worker_kills]),
            ("coordinator", [(coordinator_kill, "coordinator")]),
        ):
            began = time.monotonic()
            runs[name] = run(name, mode, args.seed, Path(tmp) / name, strikes)
            print(f"{name}: {time.monotonic() - began:.0f}s, {asdict(runs[name])}", file=sys.stderr)
    summary = summarize(runs["clean"], runs["faults"], runs["coordinator"])
    RESULTS.mkdir(exist_ok=True)
    out = {
        "mode": asdict(mode),
        "seed": args.seed,
        "runs": {k: asdict(v) for k, v in runs.items()},
        **summary,
    }
    name = "goodput" + ("-quick" if args.quick else "") + (f"-seed{args.seed}" if args.seed else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
