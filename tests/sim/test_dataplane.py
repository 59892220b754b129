"""The data plane's account: blob sizes and bytes by hand on small cases, its buckets, and a run's totals
against what the run did."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.errors import SpecError
from gpuflex.protocol.spec import JobSpec
from gpuflex.sim import report
from gpuflex.sim.dataplane import DataPlane, rounds_per_bucket
from gpuflex.sim.engine import Simulation

CHAR_GPT = 254_592  # parameters of char-gpt's default shape (``pricing.parameter_count``)
LLAMA_8B = {"parameters": 8_030_261_248, "trainable": 13_631_488, "vocab": 128_256, "dtype": "bf16"}


def _spec(data: dict | None = None, **training) -> JobSpec:
    job = {"name": "j", "resources": {"workers": 2}, "training": {"rounds": 5, **training}}
    return JobSpec.model_validate(job | ({"data": data} if data else {}))


def _lora(base: str = "./llama-3-8b", data: dict | None = None, **training) -> JobSpec:
    model = {"from": base, "block_size": 1024, "size": LLAMA_8B}
    return _spec(data, recipe="hf-causal-lm", lora={"r": 16}, model=model, **training)


def test_a_from_scratch_job_by_hand():
    """char-gpt, int8 (1 byte a value), a checkpoint every 2 rounds of 5, the default audit rate 0.05."""
    plane = DataPlane([_spec(checkpoint_every=2)], nodes=3, horizon_s=3600, bucket_s=600)
    blobs = plane.blobs[0]
    assert (blobs.pseudo_gradient, blobs.checkpoint, blobs.base) == (CHAR_GPT, 8 * CHAR_GPT, 0)
    assert blobs.corpus == 2_000_000  # data.source: the stdlib corpus, at most max_bytes
    plane.task_started(0.0, 0, node=0, rounds_done=0, first_aggregator=True)  # writes round 0's checkpoint
    plane.task_started(0.0, 0, node=1, rounds_done=0, first_aggregator=False)
    plane.task_started(0.0, 0, node=2, rounds_done=0, first_aggregator=False)
    plane.rounds_published(0, start=0.0, round_s=100.0, before=0, rounds=3, contributors=2)
    plane.task_started(400.0, 0, node=2, rounds_done=3, first_aggregator=False)  # a replacement replays 3
    plane.rounds_published(0, start=400.0, round_s=100.0, before=3, rounds=2, contributors=1)
    plane.job_completed(700.0, 0)
    served, written, transfers = plane.by_kind()
    g, ck, worker_rounds = CHAR_GPT, 8 * CHAR_GPT, 3 * 2 + 2 * 1
    assert served["corpus"] == 4 * 2_000_000
    assert served["joins"] == 3 * g
    assert served["contributions"] == served["updates"] == worker_rounds * g
    assert served["audit_states"] == pytest.approx(0.05 * worker_rounds * 48 * CHAR_GPT)
    assert served["fetches"] == ck
    assert served["base_models"] == served["shards"] == served["deployments"] == 0
    assert written["contributions"] == worker_rounds * g
    assert written["updates"] == 5 * g
    assert written["checkpoints"] == (1 + 3) * ck  # round 0, rounds 2 and 4, and the last, 5
    assert written["audit_states"] == served["audit_states"]
    assert sum(plane.served_series) == pytest.approx(sum(served.values()))
    assert sum(plane.written_series) == pytest.approx(sum(written.values()))
    # per bucket of 10 min: rounds end at 100, 200, 300 (bucket 0), 500, 600 (buckets 0 and 1)
    assert plane.served_series[1] == pytest.approx(2 * g + 0.05 * 48 * CHAR_GPT + ck)  # and the fetch
    # corpus 4, round 0's checkpoint, the replay's 1 + 3 updates, the fetch; per worker-round 3 blobs,
    # per round the update, 2 per audit, the checkpoints
    assert transfers == pytest.approx(4 + 1 + 4 + 1 + 3 * 8 + 5 + 2 * 0.05 * 8 + 3)


def test_a_join_replays_updates_near_round_zero_and_loads_the_checkpoint_past_that():
    blobs = DataPlane([_spec(rounds=40, checkpoint_every=5)], 1, 3600, 600).blobs[0]
    assert blobs.join(8) == 8 * CHAR_GPT
    assert blobs.join(9) == 8 * CHAR_GPT + 4 * CHAR_GPT  # the checkpoint of round 5 and 4 updates
    assert blobs.join(10) == 8 * CHAR_GPT


def test_a_lora_job_moves_its_adapters_and_its_nodes_cache_the_base():
    plane = DataPlane([_lora(), _lora(), _lora("./other-8b")], nodes=2, horizon_s=3600, bucket_s=600)
    blobs = plane.blobs[0]
    assert blobs.base == 2 * LLAMA_8B["parameters"]  # bf16 safetensors
    assert blobs.pseudo_gradient == LLAMA_8B["trainable"]  # int8: the adapters only
    assert blobs.checkpoint == 8 * LLAMA_8B["trainable"]
    plane.task_started(0.0, 0, node=0, rounds_done=0, first_aggregator=False)
    plane.task_started(1.0, 1, node=0, rounds_done=0, first_aggregator=False)  # the same base: cached
    plane.task_started(2.0, 2, node=0, rounds_done=0, first_aggregator=False)  # another base
    plane.task_started(3.0, 0, node=0, rounds_done=0, first_aggregator=False)  # one base a node: fetched
    plane.task_started(4.0, 0, node=1, rounds_done=0, first_aggregator=False)
    assert plane.served["base_models"] == 4 * blobs.base
    assert (plane.cache_hits, plane.cache_saved) == (1, blobs.base)


def test_prepared_shards_are_counted_as_their_tokens_are_trained_on():
    """4 x 1,024 tokens a step, 10 steps a round, uint32 tokens past a 65,536 vocabulary."""
    plane = DataPlane([_lora(data={"prepared": "./p"}, inner_steps=10, batch_size=4)], 1, 3600, 600)
    assert plane.blobs[0].corpus == 0
    plane.rounds_published(0, 0.0, 60.0, before=0, rounds=2, contributors=3)
    assert plane.by_kind()[0]["shards"] == 2 * 3 * 10 * 4 * 1024 * 4


@given(
    start=st.floats(0, 5000),
    step=st.floats(0.01, 3000),
    count=st.integers(1, 400),
    bucket_s=st.sampled_from([60.0, 600.0, 1000.0]),
)
def test_rounds_are_counted_in_the_bucket_of_their_end(start, step, count, bucket_s):
    buckets = 12
    fast, slow = [0] * buckets, [0] * buckets
    for b, n in rounds_per_bucket(buckets, bucket_s, start, step, count):
        assert fast[b] == 0 and n > 0  # one entry per bucket
        fast[b] = n
    for k in range(1, count + 1):
        slow[min(int((start + k * step) // bucket_s), buckets - 1)] += 1
    assert fast == slow


def test_deployments_need_a_sized_model(make_scenario):
    spec = {"name": "chat", "model": {"from": "./m"}, "replicas": 2}
    with pytest.raises(SpecError, match=r"model\.size"):
        make_scenario(deployments=[{"per_1000_nodes": 5, "spec": spec}])


def test_a_runs_account_matches_what_the_run_did(make_scenario):
    """Every contribution the engine credited is in the account, once; the coordinator carries the store's
    bytes when it relays them and control traffic alone with direct transfers."""
    size = {"parameters": 10**9, "trainable": 10**9, "dtype": "bf16"}
    chat = {"name": "chat", "model": {"from": "./m", "size": size}, "replicas": 2}
    sim = Simulation(make_scenario(deployments=[{"per_1000_nodes": 5, "spec": chat}])).run()
    served, written, _ = sim.traffic.by_kind()
    g = sim.traffic.blobs[0].pseudo_gradient
    worker_rounds = sum(j.worker_rounds for j in sim.jobs)
    assert worker_rounds > 0
    assert written["contributions"] == served["contributions"] == worker_rounds * g
    assert written["updates"] == sum(j.rounds_done for j in sim.jobs) * g
    assert (
        served["fetches"] == sum(j.state == "completed" for j in sim.jobs) * sim.traffic.blobs[0].checkpoint
    )
    starts = 2 * (1 + sim.horizon / sim.churn.mean_session_s())  # one deployment of 2 replicas
    assert served["deployments"] == pytest.approx(starts * 2 * 10**9)

    plane = report.data_plane(sim)
    relayed, direct = plane["coordinator"]["relayed"], plane["coordinator"]["direct"]
    control = plane["control"]
    assert plane["store"]["served_bytes"] == pytest.approx(sum(served.values()))
    assert relayed["egress_bytes"] == pytest.approx(plane["store"]["served_bytes"] + control["bytes_out"])
    assert relayed["ingress_bytes"] == pytest.approx(plane["store"]["written_bytes"] + control["bytes_in"])
    assert control["bytes_out"] < direct["egress_bytes"] < relayed["egress_bytes"] / 10
    for way in (relayed, direct):
        rates = way["egress_gbit_s"]
        assert rates["mean"] == pytest.approx(way["egress_bytes"] * 8 / 1e9 / sim.horizon)
        assert rates["peak"] >= rates["mean"]
    assert math.isclose(
        sum(
            b["store_egress_gbit_s"] * min(plane["bucket_s"], sim.horizon - b["t_h"] * 3600)
            for b in plane["series"]
        ),
        plane["store"]["served_bytes"] * 8 / 1e9,
        rel_tol=1e-9,
    )


def test_a_seed_replays_the_same_account(make_scenario):
    first, second = (report.data_plane(Simulation(make_scenario(), seed=5).run()) for _ in range(2))
    assert first == second
