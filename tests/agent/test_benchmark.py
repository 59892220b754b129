"""The short benchmark, run for real on the CPU with a tiny budget (tests never assert timing)."""

import pytest
import torch

from gpuflex.agent.benchmark import _seconds_per_call, run_benchmark

CPU = torch.device("cpu")


def test_cpu_benchmark_measures_fp32_and_bandwidth():
    result = run_benchmark("cpu", budget_s=0.1)

    assert result.tflops_fp32 > 0
    assert result.mem_bandwidth_gbps > 0
    assert result.tflops_bf16 is None  # CPU bf16 matmul is emulated: not benchmarked
    assert result.seconds > 0


@pytest.mark.parametrize("budget_s", [0, -1.0])
def test_budget_must_be_positive(budget_s):
    with pytest.raises(ValueError, match="budget_s"):
        run_benchmark("cpu", budget_s=budget_s)


def test_repetitions_fill_the_share_but_stop_at_one_when_it_is_spent():
    calls = []
    _seconds_per_call(lambda: calls.append(1), CPU, share_s=0.01)
    assert len(calls) > 2  # warm-up, sizing call, then repetitions

    calls.clear()
    _seconds_per_call(lambda: calls.append(1), CPU, share_s=0.0)
    assert len(calls) == 2


def test_the_benchmark_runs_on_the_tasks_threads_and_gives_the_process_its_own_back():
    import torch

    before = torch.get_num_threads()
    seen = []
    real = torch.set_num_threads
    torch.set_num_threads = lambda n: (seen.append(n), real(n))
    try:
        run_benchmark("cpu", budget_s=0.1, threads=1)
    finally:
        torch.set_num_threads = real
    assert seen == [1, before] and torch.get_num_threads() == before
