"""``gpuflex sim`` end to end: the report files, and the summary as the last line with ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def _gpuflex(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gpuflex", "sim", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_sim_writes_its_report_and_prints_the_summary_last(tmp_path, raw_scenario):
    path = tmp_path / "world.yaml"
    path.write_text(yaml.safe_dump(raw_scenario()))
    out = tmp_path / "report"
    done = _gpuflex(
        str(path),
        "--nodes",
        "400",
        "--hours",
        "2",
        "--seed",
        "4",
        "--json",
        "--out",
        str(out),
        cwd=tmp_path,  # anywhere: the measured ratios are found in the checkout's bench/results
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert set(summary) == {"nodes", "sim_hours", "wall_s", "events", "coordinator_egress_gbit_s"}
    assert summary["nodes"] == 400 and summary["sim_hours"] == 2 and summary["events"] > 400
    report = json.loads((out / "report.json").read_text())
    assert report["events"] == summary["events"] and report["jobs"]["arrived"] > 0
    assert report["aggregator_bandwidth"]["rows"]  # from the benchmark's measured ratios
    relayed, direct = (summary["coordinator_egress_gbit_s"][way] for way in ("relayed", "direct"))
    assert relayed == report["data_plane"]["coordinator"]["relayed"]["egress_gbit_s"]
    assert 0 < direct["mean"] < relayed["mean"] <= relayed["peak"]
    plots = (
        "utilization",
        "completion_times",
        "goodput",
        "cost_vs_cloud",
        "aggregator_bandwidth",
        "data_plane",
    )
    for plot in plots:
        assert (out / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_scenario_is_one_line_naming_the_key(tmp_path, raw_scenario):
    data = raw_scenario()
    data["gpus"][0]["tflop"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    done = _gpuflex(str(path), "--json", "--out", str(tmp_path / "r"))
    assert done.returncode == 1
    assert "gpus.0.tflop: unknown field" in done.stderr
    assert not (tmp_path / "r").exists()


def test_sim_prints_where_the_bytes_go(tmp_path, raw_scenario):
    path = tmp_path / "world.yaml"
    path.write_text(yaml.safe_dump(raw_scenario()))
    done = _gpuflex(str(path), "--nodes", "300", "--hours", "2", "--out", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    rates = report["data_plane"]["coordinator"]["relayed"]["egress_gbit_s"]
    assert f"coordinator egress, relayed: Gbit/s mean / peak │ {rates['mean']:.3g} / {rates['peak']:.3g}" in (
        " ".join(done.stdout.split())
    )
    assert "coordinator egress, direct" in done.stdout and "object store egress" in done.stdout
    served = report["data_plane"]["store"]["served"]
    largest = max(served, key=served.get)
    assert f"{largest.replace('_', ' ')} │ {served[largest] / 1e12:.3g} │" in " ".join(done.stdout.split())
