"""The short benchmark a provider registers with: the score the market ranks offers by.

Owns three measurements: dense matmul throughput in fp32 (true fp32: the default matmul precision is
left alone, so no TF32), in bf16 where the hardware does it natively (CUDA with bf16 support; on CPU
bf16 matmul is emulated and slow, so it is reported as None rather than stretching the run), and memory
bandwidth from a large tensor copy. It must stay short, since it runs at every agent start: each
measurement gets a share of ``budget_s``, one timed call sizes the repetitions to fit that share, and
the whole run ends within about twice the budget even on two cores. It uses as many threads as the
node's tasks may (``threads``; 0: torch's default), so the score is what a task can get out of the
machine. torch is imported lazily; the clock starts once it is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuflex.protocol.messages import BenchmarkResult

if TYPE_CHECKING:
    import torch

MATMUL_N = {"cpu": 1024, "cuda": 4096}  # square sides: a few ms per call on each
COPY_BYTES = {"cpu": 128 * 2**20, "cuda": 512 * 2**20}  # well past the last-level cache
MAX_REPS = 10_000


def run_benchmark(device: str = "cpu", budget_s: float = 1.5, threads: int = 0) -> BenchmarkResult:
    """Measure fp32 and bf16 TFLOPS and copy bandwidth on ``device`` ("cpu", "cuda", "cuda:1" ...)."""
    import torch

    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        return _measure(device, budget_s)
    finally:
        torch.set_num_threads(default_threads)


def _measure(device: str, budget_s: float) -> BenchmarkResult:
    import torch

    start = time.perf_counter()
    dev = torch.device(device)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    with_bf16 = kind == "cuda" and torch.cuda.is_bf16_supported()
    matmul_share = budget_s * (0.35 if with_bf16 else 0.6)
    copy_share = budget_s - matmul_share * (2 if with_bf16 else 1)
    with torch.inference_mode():
        fp32 = _matmul_tflops(dev, torch.float32, MATMUL_N[kind], matmul_share)
        bf16 = _matmul_tflops(dev, torch.bfloat16, MATMUL_N[kind], matmul_share) if with_bf16 else None
        bandwidth = _copy_gbps(dev, COPY_BYTES[kind], copy_share)
    return BenchmarkResult(
        tflops_fp32=round(fp32, 4),
        tflops_bf16=None if bf16 is None else round(bf16, 4),
        mem_bandwidth_gbps=round(bandwidth, 2),
        seconds=round(time.perf_counter() - start, 3),
    )


def _matmul_tflops(dev: torch.device, dtype: torch.dtype, n: int, share_s: float) -> float:
    import torch

    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = _seconds_per_call(lambda: torch.matmul(a, b, out=out), dev, share_s)
    return 2 * n**3 / seconds / 1e12


def _copy_gbps(dev: torch.device, nbytes: int, share_s: float) -> float:
    import torch

    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), dev, share_s)
    return 2 * nbytes / seconds / 1e9  # a copy reads every byte once and writes it once


def _seconds_per_call(fn: Callable[[], object], dev: torch.device, share_s: float) -> float:
    """Mean seconds of ``fn``: one warm-up call, one timed call to size the run, then as many as fit."""
    sync = _synchronizer(dev)
    began = time.perf_counter()
    fn()  # warm-up: first-touch page faults, kernel selection, thread pool start
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-9)
    reps = min(MAX_REPS, int((share_s - (time.perf_counter() - began)) / one))
    if reps < 1:
        return one
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()  # CUDA calls only queue work; the clock stops when the device has finished it
    return (time.perf_counter() - t0) / reps


def _synchronizer(dev: torch.device) -> Callable[[], None]:
    import torch

    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None
