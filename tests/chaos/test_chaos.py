"""Chaos: faults injected into a real network at seeded random moments; afterwards every invariant holds.

Each scenario runs a coordinator and provider agents as processes on loopback, trains a small job,
strikes while it runs (a node killed, the coordinator killed, a node frozen past its lease), lets
replacements join, and then checks the job completed and ``check_invariants`` finds nothing wrong:
no task leased twice, no stale epoch heeded, rounds contiguous, money conserved, settled once, the
journal's chain intact. ``--soak`` runs longer jobs with more faults; ``--chaos-seed`` replays one.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import select

from gpuflex.cli.inputs import upload_inputs
from gpuflex.cli.watch import TERMINAL
from gpuflex.client import Client
from gpuflex.coordinator.db import Contribution, Lease, Task, make_engine, make_sessionmaker
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.messages import JobDetail, TaskInfo
from gpuflex.testing import check_invariants, small_job, wait_for, write_corpus

pytestmark = pytest.mark.integration

# a node is lost after 3 s of silence; a lease not renewed lives 8 s
LIVENESS = {"GPUFLEX_HEARTBEAT_INTERVAL_S": "1", "GPUFLEX_HEARTBEAT_MISSES": "3", "GPUFLEX_LEASE_TTL_S": "8"}
STEP_S = "0.02"  # each agent poses as a device doing 50 steps a second: tasks leave the cores free


def _job(data_dir, rounds: int):
    """Rounds of 1.5 s, so that faults at random moments fall in different rounds."""
    return small_job(data_dir, workers=2, rounds=rounds, inner_steps=1000, round_seconds=1.5)


@dataclass
class Cluster:
    """A network and its consumer; replacement nodes join under fresh names."""

    net: LocalNetwork
    token: str
    joined: dict[str, int] = field(default_factory=lambda: {"core": 0, "c": 0})

    @classmethod
    def start(cls, net: LocalNetwork, *, core: int, community: int) -> Cluster:
        net.start_coordinator()
        cluster = cls(net, Client(net.url).create_account("chaos").token)
        cluster.client.deposit(5)
        for _ in range(core):
            cluster.add(core=True)
        for _ in range(community):
            cluster.add(core=False)
        wait_for(lambda: cluster.online() == core + community, 90, "the agents to register")
        return cluster

    def __post_init__(self) -> None:
        self.client = self.consumer(self.net.url)

    def consumer(self, url: str) -> Client:
        """Our consumer's client of the coordinator (or replica) at ``url``; it rides out restarts."""
        return Client(url, self.token, retry_for_s=60)

    def add(self, *, core: bool, url: str | None = None) -> str:
        prefix = "core" if core else "c"
        name = f"{prefix}{self.joined[prefix]}"
        self.joined[prefix] += 1
        extra = ["--emulate-step-s", STEP_S, *(["--core-token", CORE_TOKEN] if core else [])]
        self.net.start_agent(name, price=0.4 if core else 0.1, core=core, extra=extra, url=url)
        return name

    def online(self) -> int:
        return sum(o.state == "online" for o in self.client.offers())

    def submit(self, spec, client: Client | None = None) -> str:
        client = client or self.client
        return client.submit(spec, **upload_inputs(client, spec)).id

    def wait_round(self, job_id: str, round_: int) -> None:
        wait_for(lambda: self.client.job(job_id).round >= round_, 180, f"round {round_}")

    def holder(self, job_id: str, role: str, rng: random.Random) -> str:
        """The name of a node that holds a live lease on one of the job's ``role`` tasks (at random)."""
        names = {o.node_id: o.name for o in self.client.offers()}

        def held() -> list[str]:
            tasks = self.client.job(job_id).tasks
            return sorted(names[t.node_id] for t in tasks if t.role == role and t.state == "leased")

        return rng.choice(wait_for(held, 60, f"a leased {role}"))

    def wait_released(self, job_id: str, task: TaskInfo) -> None:
        """Until ``task`` is leased at a later epoch; if it is not, the job's last events say why."""

        def released() -> bool:
            return next(t for t in self.client.job(job_id).tasks if t.id == task.id).epoch > task.epoch

        try:
            wait_for(released, 60, f"task {task.id} to be leased after epoch {task.epoch}")
        except AssertionError as timeout:
            job = self.client.job(job_id)
            why = f"{timeout}; job {job.state} at round {job.round}: {self.events(job_id)[-12:]}"
            raise AssertionError(why) from None

    def wait_end(self, job_id: str) -> JobDetail:
        return wait_for(lambda: (j := self.client.job(job_id)).state in TERMINAL and j, 300, "the job to end")

    def events(self, job_id: str) -> list[str]:
        return [e.message for e in self.client.logs(job_id)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _assert_sound(cluster: Cluster, job_id: str) -> JobDetail:
    job = cluster.wait_end(job_id)
    assert job.state == "completed", cluster.events(job_id)[-12:]
    assert job.round == job.rounds
    assert job.val_loss < job.initial_val_loss
    assert check_invariants(cluster.net.database) == []
    assert [v.reason for v in cluster.client.verdicts(job_id) if v.guilty] == []  # every provider is honest
    return job


def test_nodes_killed_at_random_moments_the_aggregators_too_lose_nothing(tmp_path, chaos):
    rounds = 8 * chaos.scale
    faults = ["aggregator", "worker"] * chaos.scale
    chaos.rng.shuffle(faults)
    write_corpus(tmp_path / "data")
    with LocalNetwork(tmp_path / "net", settings=LIVENESS) as net:
        cluster = Cluster.start(net, core=2, community=3)  # 2 workers: a spare node of each kind
        job_id = cluster.submit(_job(tmp_path / "data", rounds))
        for at, role in zip(chaos.moment(1, rounds - 2, len(faults)), faults, strict=True):
            cluster.wait_round(job_id, at)
            time.sleep(chaos.rng.uniform(0, 1.5))
            victim = cluster.holder(job_id, role, chaos.rng)
            if role == "aggregator":
                net.kill_agent(victim)  # the machine dies
            else:  # the agent crashes: its orphaned task must notice and stop, it can't be renewed
                orphans = net.kill_agent(victim, with_tasks=False)
                wait_for(lambda pids=orphans: not any(map(_alive, pids)), 30, "the orphaned task to stop")
            cluster.add(core=victim.startswith("core"))  # a replacement joins the market
        _assert_sound(cluster, job_id)
        events = cluster.events(job_id)
        assert sum("lost (no heartbeat" in e for e in events) >= len(faults), events
        resumed = [e for e in events if "resuming at round" in e]
        assert len(resumed) >= faults.count("aggregator"), events


# SQLite only: killed, the embedded coordinator takes its database's writer with it (on PostgreSQL the
# database lives on, and two replicas on one are the next test's).
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_coordinator_killed_mid_job_restarts_and_nothing_is_leased_or_paid_twice(
    tmp_path, chaos, database_url
):
    rounds = 8 * chaos.scale
    write_corpus(tmp_path / "data")
    with LocalNetwork(tmp_path / "net", database_url=database_url, settings=LIVENESS) as net:
        cluster = Cluster.start(net, core=1, community=2)
        job_id = cluster.submit(_job(tmp_path / "data", rounds))
        for at in chaos.moment(1, rounds - 2, 2 * chaos.scale):
            cluster.wait_round(job_id, at)
            time.sleep(chaos.rng.uniform(0, 1.5))
            net.restart_coordinator(signal.SIGKILL, down_s=chaos.rng.uniform(0, 2))
        job = _assert_sound(cluster, job_id)
        # the nodes could not reach it while it was down: a restart judges nobody lost, re-leases nothing
        assert {t.epoch for t in job.tasks} == {1}, cluster.events(job_id)


def test_a_node_frozen_past_its_lease_is_fenced_off_when_it_wakes(tmp_path, chaos):
    write_corpus(tmp_path / "data")
    with LocalNetwork(tmp_path / "net", settings=LIVENESS) as net:
        cluster = Cluster.start(net, core=1, community=3)
        job_id = cluster.submit(_job(tmp_path / "data", 8 * chaos.scale))
        cluster.wait_round(job_id, chaos.rng.randint(1, 3))
        victim = cluster.holder(job_id, "worker", chaos.rng)
        victim_id = next(o.node_id for o in cluster.client.offers() if o.name == victim)
        task = next(t for t in cluster.client.job(job_id).tasks if t.node_id == victim_id)
        net.pause_agent(victim)  # agent and task frozen mid-round: a suspended VM, a cut cable
        cluster.wait_released(job_id, task)
        time.sleep(chaos.rng.uniform(0.5, 3))
        net.resume_agent(victim)  # it wakes up believing it still holds the lease, and acts on it
        _assert_sound(cluster, job_id)
        wait_for(
            lambda: "stale" in (log := net.log_tail(victim, 20_000)) or "revoked" in log, 30, "the refusal"
        )
        engine = make_engine(net.database)
        with make_sessionmaker(engine)() as s:
            old = s.scalars(select(Lease).where(Lease.task_id == task.id, Lease.epoch == task.epoch)).one()
            successor = s.scalars(
                select(Lease).where(Lease.task_id == task.id, Lease.epoch == task.epoch + 1)
            ).one()
            late = s.scalars(
                select(Contribution).where(
                    Contribution.lease_id == old.id, Contribution.created_at > successor.granted_at
                )
            ).all()
            assert old.state == "expired"
            assert late == []  # what it sent after waking was refused
            assert s.get(Task, task.id).failures == 0  # and its late word counted for nothing
        engine.dispose()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_two_coordinator_replicas_on_one_database_never_lease_a_task_twice(tmp_path, chaos, database_url):
    write_corpus(tmp_path / "data")
    with LocalNetwork(tmp_path / "net", database_url=database_url, settings=LIVENESS) as net:
        cluster = Cluster.start(net, core=1, community=2)
        other = net.start_replica()
        cluster.add(core=True, url=other)
        for _ in range(2):
            cluster.add(core=False, url=other)
        wait_for(lambda: cluster.online() == 6, 90, "the agents of the second replica")
        second = cluster.consumer(other)
        rounds = 6 * chaos.scale
        jobs = [
            cluster.submit(_job(tmp_path / "data", rounds)),
            cluster.submit(_job(tmp_path / "data", rounds), client=second),
        ]
        for job_id in jobs:
            _assert_sound(cluster, job_id)
