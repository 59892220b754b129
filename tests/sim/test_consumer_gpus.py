"""Real models on 24 GB cards: the market places the memory issue's jobs on them by its own estimate."""

from __future__ import annotations

from gpuflex.sim.engine import NO_JOB, Simulation
from gpuflex.sim.scenario import SCENARIO_DIR, load_scenario


def test_a_network_of_24gb_cards_trains_an_8b_lora_and_a_1b_full_fine_tune():
    """Every GPU of the community is a 24 GB card and no worker may fall back to a core node, so each job
    that starts has its workers on those cards: the estimate (19.6 and 22.2 GB) lets them."""
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
