"""Jobs as local processes (``run_local``): they train, they report, and they leave nothing behind."""

import multiprocessing
from pathlib import Path

import pytest

from gpuflex.errors import ServiceError
from gpuflex.train.local import WorkerOptions, run_local, slowdown_hook
from gpuflex.train.throttle import Link

from .helpers import tiny_spec

pytestmark = pytest.mark.filterwarnings("ignore:resource_tracker")  # conftest kills it after each test

TIMEOUT = 120  # seconds: spawning processes that import torch is slow on a busy machine

FAILING_RECIPE = b"""
from gpuflex.train.recipes.char_gpt import RECIPE as CHAR_GPT

build_model, loss = CHAR_GPT.build_model, CHAR_GPT.loss


def build_data(dataset, spec, worker_index, num_workers):
    if worker_index == 1:
        raise RuntimeError("boom: worker 1 cannot read its shard")
    return CHAR_GPT.build_data(dataset, spec, worker_index, num_workers)
"""


def _children() -> list[int]:
    """Child processes of this one, zombies too, but for the resource tracker that multiprocessing
    keeps for the lifetime of any process that spawns. Threads and children may vanish while we
    look (torch's threads come and go), so what disappears is skipped."""
    tasks = Path("/proc/self/task").iterdir()
    pids = [int(p) for task in tasks for p in (_read(task / "children") or "").split()]
    commands = {p: _read(Path(f"/proc/{p}/cmdline")) for p in pids}
    return [p for p, command in commands.items() if command is not None and "resource_tracker" not in command]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


def test_a_job_runs_as_processes_and_its_validation_loss_falls(corpus):
    seen = []
    options = [WorkerOptions(link=Link(bandwidth_bps=100e6, latency_s=0.01)), WorkerOptions(slowdown=1.5)]
    result = run_local(
        tiny_spec(rounds=2), corpus, 2, options=options, on_round=seen.append, timeout_s=TIMEOUT
    )
    assert [r.round for r in result.rounds] == [0, 1, 2] and seen == result.rounds
    assert result.rounds[-1].val_loss < result.rounds[0].val_loss - 0.5
    assert [r.contributions for r in result.rounds] == [0, 2, 2]
    assert all(r.uploaded > 0 and r.update > 0 for r in result.rounds[1:])
    assert result.aggregator.finished and result.aggregator.contributions == 4
    for worker in result.workers:
        assert worker.summary.finished and worker.summary.contributed == [0, 1]
        # the link sees the blobs the worker counts, and the messages around them
        assert worker.link.bytes_up > worker.summary.bytes_sent
        assert worker.link.bytes_down > worker.summary.bytes_received
    throttled, unthrottled = (w.link for w in result.workers)
    assert throttled.wait_s >= throttled.calls * 0.01 and unthrottled.wait_s == 0
    assert any(task == "worker-1" and "accepted" in message for task, message in result.logs)
    assert multiprocessing.active_children() == [] and _children() == []


def test_a_failing_task_is_a_clear_error_and_leaves_no_process_behind(corpus):
    spec = tiny_spec(rounds=2, recipe="user", recipe_file="failing.py")
    with pytest.raises(ServiceError, match=r"worker-1 failed: RuntimeError: boom") as raised:
        run_local(spec, corpus, 2, recipe_code=FAILING_RECIPE, timeout_s=TIMEOUT)
    assert "build_data" in str(raised.value.__cause__)  # the child's traceback comes along
    assert multiprocessing.active_children() == [] and _children() == []


def test_a_slowdown_sleeps_k_minus_one_times_each_step():
    sleeps: list[float] = []
    slow = slowdown_hook(3.0, wait=sleeps.append)
    slow(0.5)
    assert sleeps == [1.0]
    assert slowdown_hook(1.0) is None


def test_a_run_whose_workers_all_stopped_before_the_end_is_an_error_not_a_wait():
    """Every worker gone (excluded by verdicts, say) while the aggregator waits: nobody is left."""
    from gpuflex.train.local import _Outcome, orphaned
    from gpuflex.train.worker import WorkerSummary

    def ended(task: str, finished: bool, rounds: list[int]) -> _Outcome:
        return _Outcome(task, WorkerSummary(contributed=rounds, finished=finished))

    workers = {"worker-0", "worker-1"}
    stopped = {"worker-0": ended("worker-0", False, [7, 8]), "worker-1": ended("worker-1", False, [8])}
    why = orphaned(stopped, workers, tasks=3)
    assert why is not None and "worker-0 round 8, worker-1 round 8" in why
    assert orphaned({"worker-0": stopped["worker-0"]}, workers, tasks=3) is None  # one still works
    done = {**stopped, "worker-1": ended("worker-1", True, [9])}
    assert orphaned(done, workers, tasks=3) is None  # one saw the job finish: the aggregator ends too
    assert orphaned({**stopped, "aggregator-0": _Outcome("aggregator-0")}, workers, tasks=3) is None
