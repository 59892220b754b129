"""The candidate index hands the market's own placement the few nodes it needs, and the market
decides exactly as it would among every free node."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuflex.market.matching import Requirements
from gpuflex.market.placement import place_job
from gpuflex.sim.index import REPLACEMENT_POOL, CandidateIndex
from gpuflex.sim.population import Population

jobs = st.fixed_dictionaries(
    {
        "workers": st.integers(1, 6),
        "vram": st.sampled_from([0, 24, 40]),
        "region": st.sampled_from([None, "eu"]),
        "max_price": st.sampled_from([0.3, 0.7, 1.0]),
        "min_core": st.integers(0, 2),
        "fallback": st.booleans(),
        "pricing": st.sampled_from(["fixed", "auction"]),
        "aggregator": st.booleans(),
        "clearing": st.sampled_from([None, 0.25, 0.6]),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), job=jobs, free_share=st.floats(0.05, 1.0))
def test_placing_on_the_index_candidates_decides_as_placing_on_every_free_node(
    make_scenario, seed, job, free_share
):
    scenario = make_scenario()
    rng = np.random.default_rng(seed)
    pop = Population.draw(scenario, 60, rng)
    if job["pricing"] == "auction":
        job["min_core"] = 0  # the spec refuses a core quota with an auction
    else:
        job["clearing"] = None
    req = Requirements(
        job["workers"], job["vram"], 0, (), job["region"], job["max_price"], job["min_core"], job["fallback"]
    )
    index = CandidateIndex(pop, [req], [job["pricing"] == "auction"])
    reliability = rng.uniform(0.3, 1.0, pop.n)
    free = [i for i in range(pop.n) if rng.random() < free_share]
    for i in free:
        index.add(i, float(reliability[i]))
    everyone = [pop.offer(i, reliability=float(reliability[i])) for i in free]
    core_already = min(job["min_core"], 1)
    decide = lambda offers: place_job(  # noqa: E731
        req,
        job["pricing"],
        offers,
        aggregator=job["aggregator"],
        workers=job["workers"],
        busy=set(),
        core_already=core_already,
        clearing_price=job["clearing"],
    )
    candidates = index.candidates(
        0,
        aggregator=job["aggregator"],
        workers=job["workers"],
        all_workers=job["workers"],
        auction=job["pricing"] == "auction",
        clearing=job["clearing"],
        need_core=job["min_core"] > core_already,
        max_price=job["max_price"],
    )
    full, few = decide(everyone), decide(candidates.offers)
    assert few.aggregator == full.aggregator or few.aggregator.node_id == full.aggregator.node_id
    assert [c.node_id for c in few.workers.choices] == [c.node_id for c in full.workers.choices]
    assert few.clearing_price == full.clearing_price
    assert (few.workers.wait_reason is None) == (full.workers.wait_reason is None)
    replacing = job["pricing"] == "auction" and job["clearing"] is not None
    handful = 2 * REPLACEMENT_POOL + 1 if replacing else 2 * job["workers"] + 3
    assert len(candidates.offers) <= handful  # however many nodes are free


def test_a_taken_node_is_offered_again_only_once_given_back(make_scenario):
    pop = Population.draw(make_scenario(), 20, np.random.default_rng(0))
    req = Requirements(2, 0, 0, (), None, 1.0)
    index = CandidateIndex(pop, [req], [False])
    for i in range(pop.n):
        index.add(i, 0.675)
    kwargs = dict(aggregator=False, workers=2, all_workers=2, auction=False, clearing=None, need_core=False)
    first = index.candidates(0, **kwargs, max_price=1.0)
    chosen = {int(o.node_id[1:]) for o in first.offers[:1]}
    for i in chosen:
        index.remove(i)
    index.give_back(first, chosen)
    again = index.candidates(0, **kwargs, max_price=1.0)
    assert {o.node_id for o in first.offers} - {o.node_id for o in again.offers} == {
        pop.node_id(i) for i in chosen
    }
