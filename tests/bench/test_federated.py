"""``bench/federated.py``: the non-IID split, and its smallest config run end to end (Flower's part only
where ``flwr`` is installed: it is the ``[flower]`` extra, not ``[dev]``)."""

from __future__ import annotations

import pytest

from gpuflex.privacy.dp import Accountant

from . import bench_script


@pytest.fixture(scope="module")
def federated():
    return bench_script("federated")


@pytest.fixture(scope="module")
def tiny(federated, tmp_path_factory):
    return federated.measure(federated.TINY, "stdlib", 0, tmp_path_factory.mktemp("federated"))


def _classes(n_classes: int, per_class: int) -> dict[str, list[str]]:
    return {f"c{c}": [f"{c}-{i} " * 20 for i in range(per_class)] for c in range(n_classes)}


def test_the_split_places_every_document_once_and_holds_out_one_in_holdout(federated):
    classes = _classes(6, 30)
    split = federated.dirichlet_split(classes, 4, federated.ALPHA, seed=1)
    everything = [d for docs in classes.values() for d in docs]
    placed = [d for docs in split.owners for d in docs] + split.holdout
    assert sorted(placed) == sorted(everything)
    assert split.holdout == everything[federated.HOLDOUT - 1 :: federated.HOLDOUT]


def test_a_small_alpha_skews_each_class_and_a_large_one_spreads_it(federated):
    def top_share(alpha: float) -> float:
        split = federated.dirichlet_split(_classes(20, 40), 4, alpha, seed=2)
        return sum(max(s) for s in split.class_shares.values()) / len(split.class_shares)

    assert top_share(federated.ALPHA) > 0.6  # most of a class with one owner: non-IID
    assert top_share(1000.0) < 0.4  # about a quarter each


def test_the_smallest_config_trains_every_run_on_the_same_tokens_and_reports_dp_epsilon(federated, tiny):
    mode = federated.TINY
    budget = mode.rounds * mode.inner_steps * mode.batch_size * mode.block_size * federated.OWNERS
    assert set(tiny["tokens_trained"].values()) == {budget}  # every run: federated, DP, pooled, Flower
    losses = tiny["val_loss"]
    pooled = [losses[f"pooled-{d}"] for d in range(federated.POOLED_DRAWS)]
    assert len(set(pooled)) == len(pooled)  # different batch draws
    mean = sum(pooled) / len(pooled)
    assert tiny["federated_loss_gap"] == pytest.approx((losses["federated"] - mean) / mean, abs=1e-3)
    assert [d["noise_multiplier"] for d in tiny["dp"]] == list(mode.noise)
    for d in tiny["dp"]:
        assert d["epsilon"] == pytest.approx(
            Accountant(d["noise_multiplier"], federated.DELTA).epsilon(mode.rounds), rel=1e-3
        )
    assert tiny["dp"][0]["epsilon"] > tiny["dp"][-1]["epsilon"]  # more noise, less ε
    assert tiny["dp"][-1]["val_loss"] > losses["federated"]  # and at z = 1 with 4 owners, a worse model
    assert all(share > 0 for share in tiny["owners"]["train_tokens"])


def test_flower_averages_as_our_federated_job_does(federated, tiny):
    pytest.importorskip("flwr", reason="the [flower] extra is not installed")
    flower = tiny["flower"]
    # the same clients, weights and rounds: only who averages differs
    assert abs(flower["loss_difference"]) < 1e-3
    assert flower["val_loss"] == tiny["val_loss"]["flower"] and flower["wall_s"] >= 0


def test_without_flwr_the_json_says_how_to_install_it(federated):
    assert federated.flower_summary({}) == {"skipped": "flwr not installed: pip install -e '.[flower]'"}
