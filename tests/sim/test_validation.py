"""Validation: the simulator and a real local network, given the same nodes, the same job and the same
node deaths, agree on how many leases were re-assigned and on the job completing.

The real side is a coordinator and 20 agents as processes on loopback (4 core, 16 community: the
issue's "about 20"; 112 s on the shared 2-core machine with a load average of 10). A 3-worker job of
8 rounds trains while a worker, then the aggregator, then another worker are killed with ``kill -9``
(agent and task: the machine dies) once rounds 1, 3 and 5 are published. The simulator then gets
the same nodes, prices, liveness rules and job, and the same deaths after the same rounds (by round,
not by clock: a loaded machine runs the real rounds several times slower than their budget).

**Tolerance: ±1 re-assignment.** Each death of a lease holder costs exactly one re-lease in both, so
they agree exactly when nothing else happens; but on a loaded machine a live agent's heartbeat can
arrive late enough for the real coordinator to judge it lost (one re-lease more), and a death the
simulator places a moment after its job's last round costs it none (one fewer). More than one
disagreement means the two apply different rules. Completion must agree exactly.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from gpuflex.cli.inputs import upload_inputs
from gpuflex.cli.watch import TERMINAL
from gpuflex.client import Client
from gpuflex.coordinator.db import Lease, make_engine, make_sessionmaker
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.sim.engine import Fault, Simulation
from gpuflex.testing import check_invariants, small_job, wait_for, write_corpus

pytestmark = pytest.mark.integration

INTERVAL_S, MISSES, LEASE_TTL_S = 1, 3, 8  # as tests/chaos: a silent node is lost after 3 s
CORE, COMMUNITY = 4, 16
CORE_PRICE, COMMUNITY_PRICE = 0.4, 0.1
WORKERS, ROUNDS = 3, 8
DEATHS = [(1, "worker"), (3, "aggregator"), (5, "worker")]  # (round, role of the lease holder killed)
TOLERANCE = 1  # re-assignments (module docstring)


def _real_run(tmp_path) -> tuple[str, int]:
    """The job on a real network, with its deaths: its end state and its re-assignments."""
    spec = small_job(tmp_path / "data", workers=WORKERS, rounds=ROUNDS, inner_steps=1000, round_seconds=1.5)
    settings = {
        "GPUFLEX_HEARTBEAT_INTERVAL_S": str(INTERVAL_S),
        "GPUFLEX_HEARTBEAT_MISSES": str(MISSES),
        "GPUFLEX_LEASE_TTL_S": str(LEASE_TTL_S),
    }
    with LocalNetwork(tmp_path / "net", settings=settings) as net:
        net.start_coordinator()
        client = Client(net.url, Client(net.url).create_account("validation").token)
        client.deposit(5)
        for i in range(CORE):
            net.start_agent(f"core{i}", price=CORE_PRICE, core=True, extra=["--core-token", CORE_TOKEN])
        for i in range(COMMUNITY):
            net.start_agent(f"c{i}", price=COMMUNITY_PRICE, extra=["--emulate-step-s", "0.02"])
        total = CORE + COMMUNITY
        wait_for(lambda: sum(o.state == "online" for o in client.offers()) == total, 120, "the agents")
        job_id = client.submit(spec, **upload_inputs(client, spec)).id
        for round_, role in DEATHS:
            wait_for(lambda r=round_: client.job(job_id).round >= r, 180, f"round {round_}")
            names = {o.node_id: o.name for o in client.offers()}
            held = [t for t in client.job(job_id).tasks if t.role == role and t.state == "leased"]
            net.kill_agent(sorted(names[t.node_id] for t in held)[0])
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 300, "the end")
        assert check_invariants(net.database) == []
        return job.state, _reassignments(net.database, job_id)


def _reassignments(database: str, job_id: str) -> int:
    """Leases beyond each task's first."""
    engine = make_engine(database)
    try:
        with make_sessionmaker(engine)() as s:
            leases = s.scalar(select(func.count(Lease.id)).where(Lease.job_id == job_id))
            tasks = s.scalar(select(func.count(func.distinct(Lease.task_id))).where(Lease.job_id == job_id))
            return leases - tasks
    finally:
        engine.dispose()


def _simulated(make_scenario, tmp_path) -> tuple[str, int]:
    spec = small_job(tmp_path / "data", workers=WORKERS, rounds=ROUNDS, inner_steps=1000, round_seconds=1.5)
    cpu = {"name": "cpu", "share": 1, "vram_gb": 0, "tflops": 0.08}
    scenario = make_scenario(
        nodes=CORE + COMMUNITY,
        network={"heartbeat_interval_s": INTERVAL_S, "heartbeat_misses": MISSES, "lease_ttl_s": LEASE_TTL_S},
        regions=[{"name": "local", "share": 1}],
        gpus=[{**cpu, "price_per_hour": [COMMUNITY_PRICE, COMMUNITY_PRICE]}],
        links={"bandwidth_mbps": [1000, 1000], "latency_ms": [0, 1]},
        # nobody comes or goes but the nodes the test kills
        availability={"session_hours_median": 1e4, "session_sigma": 0, "offline_hours_median": 1e-6},
        core={"share": CORE / (CORE + COMMUNITY), "gpu": "cpu", "price_per_hour": CORE_PRICE},
        jobs={"arrivals_per_hour_per_1000_nodes": 1, "templates": [{"share": 1, "spec": spec.model_dump()}]},
    )
    sim = Simulation(
        scenario,
        hours=1,
        arrivals=[(0.0, 0)],
        faults=[Fault(job=0, after_round=round_, role=role) for round_, role in DEATHS],
    )
    sim.run()
    job = sim.jobs[0]
    return job.state, job.reassignments


def test_the_simulator_and_a_real_network_agree_on_re_assignments_and_completion(tmp_path, make_scenario):
    write_corpus(tmp_path / "data")
    real_state, real_reassignments = _real_run(tmp_path)
    sim_state, sim_reassignments = _simulated(make_scenario, tmp_path)
    assert real_state == sim_state == "completed"
    assert real_reassignments >= len(DEATHS)  # every death cost the real network a re-lease
    assert abs(sim_reassignments - real_reassignments) <= TOLERANCE, (real_reassignments, sim_reassignments)
