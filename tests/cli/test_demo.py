"""``gpuflex demo`` as a user runs it (one round instead of sixteen), and it leaves nothing running."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def test_the_demo_trains_reports_and_cleans_up(tmp_path):
    data_dir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "gpuflex", "demo", "--rounds", "1", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},  # one line per message: Rich wraps at 80 by default
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "4 providers online (1 core, 3 community)" in out
    before, after = (
        float(x) for x in out.split("validation loss: ")[1].split(" after")[0].split(" before -> ")
    )
    assert after < before
    assert (data_dir / "checkpoint.safetensors").stat().st_size > 100_000
    assert "cost per provider" in out and "community-3" in out
    quoted = re.search(r"quote: ≈ ([\d.]+) credits \(([\d.]+)–([\d.]+)\)", out)
    assert quoted and float(quoted[2]) <= float(quoted[1]) <= float(quoted[3]), out
    assert re.search(rf"actual: [\d.]+ credits over \d+s of leases \(quoted ≈ {quoted[1]} credits", out), out
    assert "ledger: 3 entries, chain verified" in out
    assert _processes_mentioning(str(data_dir)) == []
