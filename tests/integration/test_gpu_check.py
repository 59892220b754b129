"""``scripts/gpu-check --cpu --tiny``: the GPU check's plumbing (probe, benchmark, model directory,
tokenizer, two local fine-tunes in bf16) runs on a CPU and prints its JSON last."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu-check"


def test_the_gpu_check_runs_on_a_cpu_and_reports_each_run():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--tiny", "--no-bench", "--rounds", "1", "--inner-steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["mfu_against"] == "benchmark tflops_fp32"
    assert 500_000 < report["model"]["parameters"] < 2_000_000
    assert report["lora"]["trained_parameters"] < report["full"]["trained_parameters"] / 10
    for run in ("full", "lora", "qlora"):
        assert len(report[run]["workers"]) == 2 and len(report[run]["val_losses"]) == 2
        assert report[run]["estimate_gb"] > 0
        for worker in report[run]["workers"]:
            assert worker["tokens_per_s"] > 0 and worker["mfu"] > 0 and worker["peak_memory_mb"] > 0
    assert report["qlora"]["trained_parameters"] == report["lora"]["trained_parameters"]
    assert "memory" not in report  # --no-bench
    assert report["lora"]["workers"][0]["bytes_sent"] < report["full"]["workers"][0]["bytes_sent"] / 5
