"""``bench/memory.py``: a window's peak of tensor storage on a CPU, and the estimates its table reports."""

from __future__ import annotations

import pytest
import torch

from . import bench_script


@pytest.fixture(scope="module")
def memory():
    return bench_script("memory")


def test_a_windows_peak_is_the_tensors_alive_at_its_start_plus_the_most_it_allocated_at_once(memory):
    meter = memory.Meter("cpu")
    kept = torch.ones(2**20)  # 4 MiB, alive before the window and through it
    meter.begin()
    a = torch.ones(2**21)  # 8 MiB
    b = torch.ones(2**21)  # 8 MiB: the peak, 20 MiB with the kept tensor
    del a, b
    c = torch.ones(2**20)  # 4 MiB after the peak
    meter.end()
    assert meter.window == pytest.approx(20 * 2**20, rel=0.02)
    assert kept.numel() and c.numel()


def test_the_issues_four_training_jobs_meet_their_estimates_targets(memory):
    table = memory._table()
    for name in (
        "8B LoRA r16 q/k/v/o, bf16, checkpointing, 4 x 1,024",
        "8B QLoRA (nf4)",
        "1.2B full, bf16, checkpointing, 4 x 1,024",
        "70B QLoRA over 2 x 24 GB (Llama-2-70B, 1 x 1,024), both devices",
    ):
        assert table[name]["met"], (name, table[name])


def test_an_audits_rerun_share_counts_the_segments_between_the_kept_boundary_and_those_it_needs(memory):
    assert memory._rerun_share(4, {0, 1, 2, 3, 4}) == 0.0  # every boundary kept: nothing re-run
    # only the start: segment k re-runs k + 1 segments, the last k (the final state is the model's own)
    assert memory._rerun_share(4, {0}) == pytest.approx((1 + 2 + 3 + 3) / 16)
    assert memory._rerun_share(4, {0, 2, 4}) == pytest.approx(4 / 16)  # one segment whichever is drawn
