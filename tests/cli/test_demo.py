"""``gpuflex demo --cheater`` as a user runs it (two rounds instead of sixteen): it trains, reports, catches
and slashes its cheater, and leaves nothing running. One run covers the plain demo too, which is the
same network less the cheater (a second run cost the suite 40 s)."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def test_the_demo_trains_reports_catches_its_cheater_and_cleans_up(tmp_path):
    data_dir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "gpuflex", "demo", "--cheater", "--rounds", "2", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=420,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    out = result.stdout
    assert "5 providers online (1 core, 4 community)" in out
    before, after = (
        float(x) for x in out.split("validation loss: ")[1].split(" after")[0].split(" before -> ")
    )
    assert after < before
    assert (data_dir / "checkpoint.safetensors").stat().st_size > 100_000
    assert "cost per provider" in out and "community-3" in out
    quoted = re.search(r"quote: ≈ ([\d.]+) credits \(([\d.]+)–([\d.]+)\)", out)
    assert quoted and float(quoted[2]) <= float(quoted[1]) <= float(quoted[3]), out
    assert re.search(rf"actual: [\d.]+ credits over \d+s of leases \(quoted ≈ {quoted[1]} credits", out), out
    assert "cheater-1 staked 1.000000 credits and plays adversary 'scaled'" in out
    verdict = re.search(
        r"verdict: cheater-1 \(\S+\) guilty \(screen, round \d+\): .+; "
        r"slashed 1\.000000 credits; barred from the job",
        out,
    )
    assert verdict, out
    assert set(re.findall(r"verdict: (\S+) \(\S+\) guilty", out)) == {"cheater-1"}, out  # no honest one
    assert re.search(r"worker \d on \S+ was found cheating; re-leasing", out), out
    # to the spare: which community provider that is depends on the benchmarks' ranking
    assert re.search(r"found cheating; re-leasing\nworker \d leased to community-\d", out), out
    assert "ledger:" in out and "chain verified" in out
    assert _processes_mentioning(str(data_dir)) == []
