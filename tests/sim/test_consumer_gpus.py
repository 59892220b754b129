"""Real models on 24 GB cards: the market places the memory issue's jobs on them by its own estimate."""

from __future__ import annotations

import numpy as np

from gpuflex.market import Requirements
from gpuflex.market.placement import place_job
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.sim.engine import NO_JOB, Simulation
from gpuflex.sim.population import Population
from gpuflex.sim.scenario import SCENARIO_DIR, load_scenario


def test_a_network_of_24gb_cards_trains_an_8b_lora_and_a_1b_full_fine_tune():
    """Every GPU of the community is a 24 GB card and no worker may fall back to a core node, so each job
    that starts has its workers on those cards: the estimate (19.7 and 22.3 GB) lets them."""
    scenario = load_scenario(SCENARIO_DIR / "consumer-24gb.yaml")
    sim = Simulation(scenario, nodes=300, hours=4, seed=1)
    seen: dict[str, set[float]] = {}
    place = sim._place_job

    def spy(job, *args):  # the nodes each placement pass gives a job's workers
        place(job, *args)
        vram = {sim.pop.offer(i, reliability=1.0).vram_gb for i in job.workers}
        seen.setdefault(job.spec.name, set()).update(vram)

    sim._place_job = spy
    sim.run()
    started = {job.spec.name for job in sim.jobs if job.started_at is not None}
    assert started == {"llama-8b-lora", "llama-1b-full"}
    assert seen["llama-8b-lora"] == seen["llama-1b-full"] == {24.0}
    assert all(job.aggregator == NO_JOB or job.aggregator < sim.pop.n_core for job in sim.jobs)


def test_the_same_network_places_an_8b_deployment_on_24gb_cards():
    """A deployment of the 8B model (bf16, context 4,096, 8 requests: 22.0 GB by the serve estimate) is
    placed by the placement the simulator and the coordinator share, on the scenario's community cards;
    in fp32 (42.8 GB) no 24 GB card qualifies and only the core's A100s are left."""
    scenario = load_scenario(SCENARIO_DIR / "consumer-24gb.yaml")
    pop = Population.draw(scenario, 300, np.random.default_rng(1))
    offers = [pop.offer(i, reliability=1.0) for i in range(pop.n)]
    size = scenario.jobs.templates[0].spec.training.model.size

    def placed(dtype: str) -> set[float]:
        spec = DeploymentSpec(
            name="llama-8b-chat",
            model={"from": "./llama-3-8b", "size": size},
            replicas=4,
            context=4096,
            max_batch=8,
            dtype=dtype,
        )
        decision = place_job(
            Requirements.from_spec(spec), "fixed", offers, aggregator=False, workers=4, busy=set()
        )
        chosen = [int(c.node_id[1:]) for c in decision.workers.choices]
        assert len(chosen) == 4
        return {float(pop.vram_gb[i]) for i in chosen}

    assert placed("bf16") == {24.0}
    assert placed("fp32") == {80.0}
