"""The simulator's scaling curve: ``gpuflex sim --nodes N --hours 24 --json`` for N = 10k, 100k, 1M.

    .venv/bin/python bench/sim_scale.py                    # 10k, 100k, 1M nodes x 24 h
    .venv/bin/python bench/sim_scale.py --nodes 10000 100000 --hours 6
    .venv/bin/python bench/sim_scale.py --scenario llm-8b --nodes 10000 1000000 \
        --out bench/results/sim_scale-llm-8b.json         # the data plane of a job mix on 8B models

Each size runs as its own process (a fresh interpreter, as a user would run it), with the shipped
``community-mix`` scenario and seed 0. For each it keeps the command's own summary line (``wall_s``
covers building the world and simulating it, not writing the plots) and the CPU seconds of that same
span (``cpu_s``, from the report; ``process_cpu_s`` is the whole process with start-up and plots): on
a shared machine the wall clock counts other people's work too, the CPU time does not.
Each point also keeps the report's data plane (``sim.dataplane``): what the object store served by kind,
and the coordinator's and the store's egress with every blob relayed and with direct transfers.
Targets (issue 8, on 2 cores): 100k x 24 h in at most 30 s; 1M x 24 h in at most 5 minutes.
Writes ``bench/results/sim_scale.json`` (``--out``); the last stdout line is the same JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "sim_scale.json"
TARGETS_S = {100_000: 30.0, 1_000_000: 300.0}  # at 24 simulated hours


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(nodes: int, hours: float, scenario: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "gpuflex", "sim", scenario, "--nodes", str(nodes)]
        command += ["--hours", str(hours), "--seed", "0", "--json", "--out", out]
        cpu_before, started = _children_cpu_s(), time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        process_s = time.perf_counter() - started
        summary = json.loads(done.stdout.splitlines()[-1])
        report = json.loads((Path(out) / "report.json").read_text())
    return {
        **summary,
        "cpu_s": report["cpu_s"],
        "process_cpu_s": round(_children_cpu_s() - cpu_before, 3),
        "process_wall_s": round(process_s, 3),  # with interpreter start-up and the report's plots
        "events_per_s": round(summary["events"] / summary["wall_s"]),
        "jobs": report["jobs"],
        "utilization": report["utilization"]["mean"],
        "goodput": report["goodput"]["overall"],
        "target_s": TARGETS_S.get(nodes) if hours == 24 else None,
        "data_plane": _data_plane(report["data_plane"]),
    }


def _data_plane(plane: dict) -> dict:
    """The report's data plane without its time series."""
    coordinator = plane["coordinator"]
    return {
        "store_served_bytes": plane["store"]["served"],
        "store_written_bytes": plane["store"]["written"],
        "store_egress_gbit_s": plane["store"]["egress_gbit_s"],
        "coordinator_egress_gbit_s": {way: coordinator[way]["egress_gbit_s"] for way in coordinator},
        "coordinator_carried_bytes": {way: coordinator[way]["carried_bytes"] for way in coordinator},
        "control": plane["control"],
        "node_cache": plane["node_cache"],
        "deployments": plane["deployments"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--scenario", default="community-mix")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    curve = []
    for nodes in args.nodes:
        point = run(nodes, args.hours, args.scenario)
        print(
            f"{nodes:>9,} nodes: {point['wall_s']:.1f} s wall, {point['cpu_s']:.1f} s CPU, "
            f"{point['events']:,} events",
            file=sys.stderr,
        )
        curve.append(point)
    result = {"scenario": args.scenario, "hours": args.hours, "curve": curve}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
