"""``bench/diloco_vs_ddp.py``'s pure logic: the comparison against the better DDP baseline, each optimizer's
frontier against its own DDP, the size sweep's falling-gap verdict, and merging a split run's results."""

from __future__ import annotations

import json

import pytest

from . import bench_script


@pytest.fixture(scope="module")
def bench():
    return bench_script("diloco_vs_ddp")


def row(name: str, val_loss: float, bytes_per_worker: float, kind: str, optimizer: str) -> dict:
    return {
        "name": name,
        "val_loss": val_loss,
        "bytes_per_worker": bytes_per_worker,
        "kind": kind,
        "optimizer": optimizer,
    }


def rows() -> list[dict]:
    """AdamW's DDP is weak (2.0), Muon's strong (1.8): AdamW's int2 is within 2% of its own DDP only."""
    return [
        row("ddp-adamw", 2.0, 1000.0, "ddp", "adamw"),
        row("ddp-muon", 1.8, 1000.0, "ddp", "muon"),
        row("diloco-adamw-fp32", 2.01, 10.0, "diloco", "adamw"),
        row("diloco-adamw-int2", 2.03, 1.0, "diloco", "adamw"),
        row("diloco-muon-fp32", 1.81, 10.0, "diloco", "muon"),
        row("diloco-muon-int2", 1.85, 1.0, "diloco", "muon"),
    ]


def test_every_config_is_measured_against_the_better_ddp(bench):
    table = rows()
    result = bench.compare(table)

    assert result["ddp_baseline"] == "ddp-muon"
    by_name = {r["name"]: r for r in table}
    assert by_name["diloco-adamw-int2"]["loss_gap"] == pytest.approx(2.03 / 1.8 - 1)  # not 2.03 / 2.0
    assert by_name["diloco-adamw-int2"]["loss_gap_vs_own_ddp"] == pytest.approx(2.03 / 2.0 - 1)
    assert by_name["diloco-muon-int2"]["bytes_ratio_vs_ddp"] == pytest.approx(1000.0)
    # only muon-fp32 (0.56%) is within 2% of the better DDP; adamw-int2 (1.5% behind its own) is not
    assert result["best_config"] == "diloco-muon-fp32"
    assert result["best_bytes_ratio_vs_ddp"] == pytest.approx(100.0)
    assert result["loss_gap"] == pytest.approx(1.81 / 1.8 - 1)
    assert [p["name"] for p in result["frontier"]] == ["diloco-muon-fp32", "diloco-muon-int2"]


def test_the_better_baseline_is_the_lower_loss_whichever_optimizer(bench):
    table = rows()
    table[0]["val_loss"] = 1.7  # now AdamW's DDP is the better one
    result = bench.compare(table)
    assert result["ddp_baseline"] == "ddp-adamw"
    assert {r["name"]: r["loss_gap"] for r in table if r["kind"] == "diloco"}["diloco-muon-fp32"] == (
        pytest.approx(1.81 / 1.7 - 1)
    )
    assert result["best_config"] is None and result["best_bytes_ratio_vs_ddp"] is None


def test_each_optimizer_keeps_its_frontier_against_its_own_ddp(bench):
    per = bench.compare(rows())["per_optimizer"]

    assert per["adamw"]["ddp"] == "ddp-adamw" and per["muon"]["ddp"] == "ddp-muon"
    # against its own (weaker) DDP, AdamW's int2 qualifies and is the most compressed
    assert per["adamw"]["best_config"] == "diloco-adamw-int2"
    assert per["adamw"]["best_bytes_ratio_vs_ddp"] == pytest.approx(1000.0)
    assert per["adamw"]["loss_gap"] == pytest.approx(0.015)
    assert [p["name"] for p in per["adamw"]["frontier"]] == ["diloco-adamw-fp32", "diloco-adamw-int2"]
    assert per["muon"]["best_config"] == "diloco-muon-fp32"  # muon-int2 is 2.8% behind
    assert {p["name"] for p in per["muon"]["frontier"]} == {"diloco-muon-fp32", "diloco-muon-int2"}


def test_a_dominated_config_is_off_the_frontier(bench):
    table = [*rows(), row("diloco-muon-int8", 1.86, 5.0, "diloco", "muon")]  # worse and bigger than int2
    result = bench.compare(table)
    assert "diloco-muon-int8" not in [p["name"] for p in result["frontier"]]
    assert "diloco-muon-int8" not in [p["name"] for p in result["per_optimizer"]["muon"]["frontier"]]


def test_an_optimizer_without_its_ddp_has_no_own_frontier(bench):
    table = [r for r in rows() if r["name"] != "ddp-adamw"]
    result = bench.compare(table)
    assert set(result["per_optimizer"]) == {"muon"}
    adamw = next(r for r in table if r["name"] == "diloco-adamw-fp32")
    assert "loss_gap" in adamw and "loss_gap_vs_own_ddp" not in adamw


def test_without_a_ddp_run_nothing_is_compared(bench):
    result = bench.compare([r for r in rows() if r["kind"] == "diloco"])
    assert result["ddp_baseline"] is None and result["best_config"] is None
    assert result["frontier"] == [] and result["per_optimizer"] == {}


def test_the_gap_falls_with_size_only_if_every_larger_model_is_closer(bench):
    assert bench.falls_with_size([(1e5, 0.05), (4e5, 0.03), (1.6e6, 0.01)]) is True
    assert bench.falls_with_size([(1.6e6, 0.01), (1e5, 0.05), (4e5, 0.03)]) is True  # sorted by size
    assert bench.falls_with_size([(1e5, 0.05), (4e5, 0.01), (1.6e6, 0.03)]) is False
    assert bench.falls_with_size([(1e5, 0.03), (4e5, 0.03)]) is False  # flat is not falling
    assert bench.falls_with_size([(1e5, 0.03)]) is None


def sized(gaps: dict[str, tuple[float, float]]) -> dict:
    """One size's entry: DDPs at 2.0 (adamw) and 1.8 (muon), DiLoCo fp32 at the given own-gaps."""
    return {
        "params": gaps["params"],
        "configs": [
            row("ddp-adamw", 2.0, 1.0, "ddp", "adamw"),
            row("ddp-muon", 1.8, 1.0, "ddp", "muon"),
            row("diloco-adamw-fp32", 2.0 * (1 + gaps["adamw"]), 1.0, "diloco", "adamw"),
            row("diloco-muon-fp32", 1.8 * (1 + gaps["muon"]), 1.0, "diloco", "muon"),
        ],
    }


def test_the_size_sweep_reports_each_configs_gaps_and_verdict(bench):
    per_size = {
        "0.1M": sized({"params": 1e5, "adamw": 0.04, "muon": 0.03}),
        "0.4M": sized({"params": 4e5, "adamw": 0.02, "muon": 0.035}),  # muon's gap rises here
    }
    for entry in per_size.values():
        bench.compare(entry["configs"])
    result = bench.size_gaps(per_size)

    adamw, muon = result["gaps"]["adamw"]["fp32"], result["gaps"]["muon"]["fp32"]
    assert adamw["own"] == pytest.approx({"0.1M": 0.04, "0.4M": 0.02})
    assert adamw["better"] == pytest.approx({"0.1M": 2.08 / 1.8 - 1, "0.4M": 2.04 / 1.8 - 1})
    assert adamw["falls_own"] is True and adamw["falls_better"] is True
    assert muon["falls_own"] is False
    assert result["falls_for_every_config"] is False


def test_one_size_decides_nothing(bench):
    per_size = {"0.1M": sized({"params": 1e5, "adamw": 0.04, "muon": 0.03})}
    bench.compare(per_size["0.1M"]["configs"])
    result = bench.size_gaps(per_size)
    assert result["gaps"]["muon"]["fp32"]["falls_own"] is None
    assert result["falls_for_every_config"] is None


def test_the_sizes_are_named_for_their_parameters(bench):
    for name, size in bench.SIZES.items():
        assert size.params == pytest.approx(float(name.removesuffix("M")) * 1e6, rel=0.25), name
    assert [bench.SIZES[n].params for n in bench.CPU_SIZES] == sorted(
        bench.SIZES[n].params for n in bench.CPU_SIZES
    )


def test_configs_carry_their_optimizer_and_the_quick_ones_exist(bench):
    muon = bench.BY_NAME["diloco-muon-int2"]
    assert muon.optimizer == "muon" and muon.lr == bench.MUON_LR and not muon.ddp
    assert bench.BY_NAME["diloco-adamw-int2"].optimizer == "adamw"
    assert bench.BY_NAME["ddp-muon"].ddp and bench.BY_NAME["ddp-muon"].optimizer == "muon"
    assert len(bench.CONFIGS) == 10 and len(bench.BASELINES) == 2
    known = set(bench.BY_NAME) | {bench.HETERO_NAME}
    assert set(bench.QUICK_CONFIGS) <= known and set(bench.SIZE_CONFIGS) <= set(bench.BY_NAME)
    spec = bench.spec_for(bench.QUICK, 3, muon)
    assert spec.inner_optimizer == "muon" and spec.lr == bench.MUON_LR and spec.seed == 3


def test_unknown_names_are_refused(bench):
    known = ["ddp-adamw", "diloco-muon-int2"]
    assert bench._names("diloco-muon-int2, ddp-adamw", known, None, "configs") == known[::-1]
    assert bench._names(None, known, ("ddp-adamw",), "configs") == ["ddp-adamw"]
    assert bench._names(None, known, None, "configs") == known
    with pytest.raises(SystemExit, match="diloco-muon-int3"):
        bench._names("diloco-muon-int3", known, None, "configs")


def test_results_files_carry_the_corpus_and_the_mode(bench, tmp_path):
    corpus = tmp_path / "change logs"
    corpus.mkdir()
    assert bench.results_stem("diloco_vs_ddp", "stdlib", False) == "diloco_vs_ddp"
    assert bench.results_stem("diloco_vs_ddp", "stdlib", True) == "diloco_vs_ddp-quick"
    assert bench.results_stem("diloco_sizes", str(corpus), True) == "diloco_sizes-change_logs-quick"
    assert bench.results_stem("diloco_vs_ddp", f"{corpus}/", False) == "diloco_vs_ddp-change_logs"


def run(bench, name: str, seed: int, val_loss: float, size: str = ""):
    return bench.Run(name, seed, val_loss, 1.0, 1.0, 1.0, [(1.0, 1.0, val_loss)], size=size)


def test_a_split_run_merges_into_the_results_of_the_same_settings(bench, tmp_path):
    earlier = [
        run(bench, "ddp-adamw", 0, 2.0),
        run(bench, "ddp-adamw", 1, 2.1),
        run(bench, "ddp-muon", 0, 1.9),
    ]
    merged = bench.merge(earlier, [run(bench, "ddp-adamw", 1, 2.2), run(bench, "ddp-adamw", 2, 2.3)])
    assert [(r.name, r.seed, r.val_loss) for r in merged] == [
        ("ddp-adamw", 0, 2.0),
        ("ddp-muon", 0, 1.9),
        ("ddp-adamw", 1, 2.2),  # redone: replaced
        ("ddp-adamw", 2, 2.3),
    ]
    assert (
        len(bench.merge([run(bench, "ddp-adamw", 0, 2.0, "0.1M")], [run(bench, "ddp-adamw", 0, 2.0, "0.4M")]))
        == 2
    )
    hetero = bench.merge_hetero(
        [{"seed": 0, "slowdown": 1.1}, {"seed": 1, "slowdown": 1.2}], [{"seed": 0, "slowdown": 1.3}]
    )
    assert hetero == [{"seed": 0, "slowdown": 1.3}, {"seed": 1, "slowdown": 1.2}]

    settings = {"mode": "quick", "steps_per_worker": 200}
    path = tmp_path / "results.json"
    path.write_text(
        json.dumps(
            {"settings": settings, "runs": [bench.asdict(r) for r in earlier], "hetero": {"per_seed": hetero}}
        )
    )
    runs, per_seed = bench.prior_runs(path, settings)
    assert [(r.name, r.seed) for r in runs] == [(r.name, r.seed) for r in earlier] and per_seed == hetero
    assert bench.prior_runs(path, {**settings, "steps_per_worker": 1200}) == (
        [],
        [],
    )  # other settings: start over
    assert bench.prior_runs(tmp_path / "absent.json", settings) == ([], [])


def test_the_summary_compares_what_ran_and_keeps_the_heterogeneous_case(bench):
    runs = [
        run(bench, "ddp-adamw", 0, 2.0),
        run(bench, "diloco-adamw-int2", 0, 2.02),
        run(bench, "hetero-equal-budgeted", 0, 2.1),
    ]
    hetero = [{"seed": 0, "target_loss": 2.1, "slowdown": 1.2, "sync_slowdown": None}]
    summary = bench._summary({"mode": "quick"}, runs, hetero)
    assert [r["name"] for r in summary["configs"]] == ["ddp-adamw", "diloco-adamw-int2"]
    assert summary["ddp_baseline"] == "ddp-adamw" and summary["loss_gap"] == pytest.approx(0.01)
    assert (
        summary["hetero_slowdown"] == pytest.approx(1.2)
        and summary["hetero_sync_slowdown_reached"] == "0/1 seeds"
    )


def test_the_overlap_is_set_beside_the_same_config_without_it(bench):
    table = [
        row("ddp-adamw", 2.0, 1000.0, "ddp", "adamw"),
        row("diloco-adamw-int2", 2.02, 1.0, "diloco", "adamw") | {"utilization": 0.8},
        row("diloco-adamw-int2-overlap", 2.05, 1.0, "diloco", "adamw") | {"utilization": 0.97},
        row("diloco-adamw-topk2%-int2-overlap", 2.5, 0.5, "diloco", "adamw") | {"utilization": 0.96},
    ]
    bench.compare(table)
    int2, topk = bench.overlap_costs(table)
    assert int2["name"] == "diloco-adamw-int2-overlap" and int2["without"] == "diloco-adamw-int2"
    assert int2["utilization"] == 0.97 and int2["utilization_without"] == 0.8
    assert int2["gap_cost"] == pytest.approx(0.015)
    assert topk["without"] is None and topk["gap_cost"] is None


def test_every_size_runs_whole_rounds_so_ddp_and_diloco_see_the_same_tokens(bench):
    for size in bench.SIZES.values():
        for quick in (False, True):
            steps = size.steps_for(quick)
            assert steps > 0 and all(steps % c.inner_steps == 0 for c in bench.CONFIGS), (size.name, quick)
    assert bench.SIZES["1.6M"].steps_for(True) == 250  # a third of 700, to the nearest round of 50
    mode = bench.Mode(bench.MODEL, 225, (0,), 8, 0, 0.0)  # 4.5 rounds: DDP would train 25 steps more
    with pytest.raises(AssertionError, match="whole rounds"):
        bench.run_config(mode, 0, b"", bench.BY_NAME["diloco-adamw-int2"])


def test_a_size_defined_otherwise_drops_only_its_own_runs(bench, tmp_path):
    sizes = {"0.1M": {"steps": 300}, "1.6M": {"steps": 675}}
    settings = {"mode": "quick", "sizes": sizes}
    earlier = [run(bench, "ddp-adamw", 0, 2.0, "0.1M"), run(bench, "ddp-adamw", 0, 1.9, "1.6M")]
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"settings": settings, "runs": [bench.asdict(r) for r in earlier]}))

    runs, _ = bench.prior_runs(path, {"mode": "quick", "sizes": {**sizes, "1.6M": {"steps": 700}}})
    assert [r.size for r in runs] == ["0.1M"]
    assert bench.prior_runs(path, {"mode": "default", "sizes": sizes}) == ([], [])
