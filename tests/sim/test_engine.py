"""The event engine on small worlds: its bookkeeping holds whatever the seed, and batching unchanged
rounds into one event changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuflex.market.pricing import ROUND_OVERHEAD_S, step_seconds
from gpuflex.sim import engine
from gpuflex.sim.engine import NO_JOB, Simulation
from gpuflex.sim.scenario import parse_scenario


def _holders(sim: Simulation) -> dict[int, int]:
    """Every node holding a lease, with its job; asserts no node holds two."""
    held: dict[int, int] = {}
    for job in sim.jobs:
        for i in [job.aggregator, *job.workers] if job.aggregator != NO_JOB else list(job.workers):
            assert i not in held, f"node {i} is leased by jobs {held[i]} and {job.id}"
            held[i] = job.id
    return held


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1_000_000), nodes=st.integers(20, 300), crash=st.floats(0, 1))
def test_every_job_is_accounted_for_and_no_node_is_leased_twice(make_scenario, seed, nodes, crash):
    availability = {"session_hours_median": 1, "offline_hours_median": 1, "crash_share": crash}
    sim = Simulation(make_scenario(availability=availability), nodes=nodes, seed=seed).run()
    states = [j.state for j in sim.jobs]
    assert len(states) == sum(states.count(s) for s in ("pending", "running", "completed", "failed"))
    for job in sim.jobs:
        if job.state == "completed":
            assert job.rounds_done == job.spec.training.rounds or job.cost_micro > 0
            assert job.finished_at >= job.started_at >= job.arrived_at
        if job.state in ("completed", "failed"):
            assert not job.workers and job.aggregator == NO_JOB  # a finished job holds nothing
    held = _holders(sim)
    assert {i for i in range(sim.pop.n) if sim.busy_job[i] != NO_JOB} == set(held)
    for job in sim.jobs:  # what each job keeps of its members matches its members
        assert set(job.granted_at) == {i for i, j in held.items() if j == job.id}
        assert (
            set(job.worker_tflops) == set(job.worker_bandwidth) == set(job.worker_latency) == set(job.workers)
        )
        assert job.workers_down == sum(not sim.online[i] for i in job.workers)
    assert all(sim.busy_job[i] == job for i, job in held.items())
    assert sim.n_busy == len(held) and sim.n_online == sum(sim.online)
    times = [s.t for s in sim.samples]
    assert times == sorted(times)
    assert sim.count.useful_worker_s <= sim.count.paid_worker_s * (1 + 1e-9)


def test_one_event_per_stretch_of_rounds_gives_what_one_event_per_round_gives(make_scenario, monkeypatch):
    def run(one_by_one: bool) -> tuple:
        sim = Simulation(make_scenario(), nodes=300, hours=6, seed=3)
        if one_by_one:
            stretch = sim._stretch
            monkeypatch.setattr(sim, "_stretch", lambda job, start, rounds: stretch(job, start, 1))
        sim.run()
        jobs = [(j.state, j.rounds_done, j.worker_rounds, j.reassignments, j.cost_micro) for j in sim.jobs]
        traffic = sim.traffic.served_series + sim.traffic.written_series
        return (
            jobs,
            round(sim.count.useful_worker_s, 3),
            round(sim.count.paid_worker_s, 3),
            traffic,
            sim.count.events,
        )

    batched, per_round = run(False), run(True)
    assert batched[:3] == per_round[:3]
    assert batched[3] == pytest.approx(per_round[3])  # the data plane books each round at its end
    assert batched[4] < per_round[4]  # and it took fewer events


def test_a_seed_replays_the_same_run(make_scenario):
    runs = [Simulation(make_scenario(), nodes=150, seed=9).run() for _ in range(2)]
    assert [(j.state, j.cost_micro) for j in runs[0].jobs] == [(j.state, j.cost_micro) for j in runs[1].jobs]
    assert runs[0].count.events == runs[1].count.events


def _two_crashes(raw_scenario, **network) -> Simulation:
    """A 60-round job on 30 nodes that lose nobody but its worker after round 2 and aggregator after 4."""
    data = raw_scenario(
        availability={"session_hours_median": 1e4, "session_sigma": 0, "offline_hours_median": 1e-6},
        network=network,
    )
    data["jobs"]["templates"][0]["spec"]["training"]["rounds"] = 60  # outlasts the 6 s it takes to notice
    return Simulation(
        parse_scenario(data),
        nodes=30,
        hours=1,
        arrivals=[(0.0, 0)],
        faults=[
            engine.Fault(job=0, after_round=2, role="worker"),
            engine.Fault(job=0, after_round=4, role="aggregator"),
        ],
    ).run()


def test_a_crash_is_noticed_by_the_liveness_rule_and_its_lease_re_assigned(raw_scenario):
    sim = _two_crashes(raw_scenario)
    job = sim.jobs[0]
    assert job.state == "completed" and job.rounds_done == 60
    assert job.reassignments == 2 and sim.count.crashes_noticed == 2


def test_a_fleet_stretched_to_a_longer_interval_notices_crashes_later(raw_scenario):
    base = _two_crashes(raw_scenario).jobs[0]
    # 30 nodes at most 1 beat/s: every 30 s, so a silent node is lost after 90 s, not 6 s
    slow = _two_crashes(raw_scenario, heartbeat_max_rate_per_s=1.0).jobs[0]
    assert slow.state == base.state == "completed" and slow.reassignments == base.reassignments == 2
    waited = (slow.finished_at - slow.started_at) - (base.finished_at - base.started_at)
    # the job stalls until its dead aggregator is noticed: 60 to 90 s after the crash, rather than 4 to 6
    assert waited >= 90 - 30 - 6


def test_a_lora_jobs_round_exchanges_its_adapters_not_its_base(raw_scenario):
    """As quotes time a round (``pricing.trained_count``): an 8B base with 13.6M adapters, int8, over
    100 Mbit/s links moves 2 x 13.6 MB a round (2 s), not 2 x 8 GB (21 minutes)."""
    size = {"parameters": 8_030_261_248, "trainable": 13_631_488, "layers": 32, "hidden": 4096}
    model = {"from": "./llama-3-8b", "block_size": 1024, "size": size}
    training = {"recipe": "hf-causal-lm", "rounds": 3, "inner_steps": 10, "batch_size": 4}
    training |= {"compression": "int8", "lora": {"r": 16}, "model": model}
    job = {"name": "lora", "resources": {"workers": 2, "min_vram_gb": 40}, "training": training}
    data = raw_scenario(
        gpus=[{"name": "A100", "share": 1, "vram_gb": 80, "tflops": 312, "price_per_hour": [0.5, 0.5]}],
        links={"bandwidth_mbps": [100, 100], "latency_ms": [10, 10]},
        jobs={
            "arrivals_per_hour_per_1000_nodes": 1,
            "templates": [{"share": 1, "spec": job | {"budget": 50}}],
        },
    )
    sim = Simulation(parse_scenario(data), nodes=20, hours=1, arrivals=[(0.0, 0)]).run()
    spec = sim.templates[0].training
    link = 100e6 / 8  # the workers' own links, slower than the core aggregator's shared 10 Gbit/s
    compute = 10 * step_seconds(spec, 312)
    exchange = 2 * 13_631_488 / link + ROUND_OVERHEAD_S + 2 * (0.010 + 0.005)
    assert sim.jobs[0].state == "completed"
    assert sim.jobs[0].round_s == pytest.approx(compute + exchange)
