"""``gpuflex sim``: the market and lease code against a simulated network of many nodes.

    gpuflex sim                                   # the shipped community-mix scenario, 100,000 nodes, 24 h
    gpuflex sim volunteer-churn --nodes 1000000 --hours 24 --json --out sim-report
    gpuflex sim my-scenario.yaml --seed 3

It loads a scenario (a file, or a shipped one by name: ``gpuflex.sim.scenario.shipped``), runs
``gpuflex.sim.engine.Simulation`` and writes its report (JSON + PNG plots) to ``--out``. With
``--json`` the last line of stdout is ``{"nodes", "sim_hours", "wall_s", "events",
"coordinator_egress_gbit_s"}`` (mean and peak, with every blob relayed and with direct transfers);
without it, a progress bar while it runs, a short table after and where the object store's bytes go.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuflex.sim import bandwidth, report
from gpuflex.sim.engine import Simulation
from gpuflex.sim.scenario import load_scenario, shipped

console = Console()


def sim(
    scenario: Annotated[
        str, typer.Argument(help=f"a scenario file, or a shipped one: {', '.join(shipped())}")
    ] = "community-mix",
    nodes: Annotated[
        int | None, typer.Option(min=1, help="simulated nodes (default: the scenario's)")
    ] = None,
    hours: Annotated[
        float | None, typer.Option(min=0.001, help="simulated hours (default: the scenario's)")
    ] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="random seed (default: the scenario's)")] = None,
    out: Annotated[Path, typer.Option(help="directory for report.json and the plots")] = Path("sim-report"),
    bench_results: Annotated[
        Path, typer.Option(help="diloco_vs_ddp.py's results: the measured compression ratios")
    ] = bandwidth.DEFAULT_RESULTS,
    as_json: Annotated[
        bool, typer.Option("--json", help="no progress; the summary as the last line")
    ] = False,
) -> None:
    """Simulate a network of many nodes with the real market, lease, liveness and pricing code."""
    world = load_scenario(scenario)
    started, cpu_started = time.perf_counter(), time.process_time()
    simulation = Simulation(world, nodes=nodes, hours=hours, seed=seed)
    if as_json:
        simulation.run()
    else:
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[h]}"),
            TimeElapsedColumn(),
        ) as bar:
            task = bar.add_task(f"{world.name}, {simulation.pop.n:,} nodes", total=simulation.horizon, h="")
            simulation.run(lambda t: bar.update(task, completed=t, h=f"{t / 3600:.1f} h simulated"))
            bar.update(task, completed=simulation.horizon)
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    written = report.write(simulation, wall_s, out, bench_results, cpu_s=cpu_s)
    if as_json:
        print(json.dumps(report.summary(simulation, wall_s)))
        return
    _show(written, out)


def _show(r: dict, out: Path) -> None:
    table = Table(title=f"{r['scenario']}: {r['nodes']:,} nodes, {r['sim_hours']:g} h in {r['wall_s']:.1f} s")
    table.add_column("")
    table.add_column("", justify="right")
    jobs = r["jobs"]
    rows = [
        ("events", f"{r['events']:,}"),
        (
            "jobs arrived / completed / failed",
            f"{jobs['arrived']:,} / {jobs['completed']:,} / {jobs['failed']:,}",
        ),
        ("mean utilization", _pct(r["utilization"]["mean"])),
        ("goodput", _pct(r["goodput"]["overall"])),
        ("leases re-assigned", f"{r['goodput']['reassignments']:,}"),
        ("completion, median (h)", _num(r["completion_h"]["p50"])),
    ]
    for name, row in r["cost"]["per_template"].items():
        rows.append((f"{name}: cost ÷ cloud, median", _num(row["cost_over_cloud"]["p50"])))
    plane = r["data_plane"]
    for way in ("relayed", "direct"):
        rates = plane["coordinator"][way]["egress_gbit_s"]
        rows.append(
            (
                f"coordinator egress, {way}: Gbit/s mean / peak",
                f"{_num(rates['mean'])} / {_num(rates['peak'])}",
            )
        )
    rates = plane["store"]["egress_gbit_s"]
    rows.append(("object store egress: Gbit/s mean / peak", f"{_num(rates['mean'])} / {_num(rates['peak'])}"))
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)
    console.print(_store_table(plane))
    console.print(f"report: {out / 'report.json'} and plots in {out}/")


def _store_table(plane: dict) -> Table:
    """What the object store serves, by kind, largest first: where the bandwidth goes."""
    store = plane["store"]
    total = store["served_bytes"] or 1.0
    table = Table(title=f"object store served {store['served_bytes'] / 1e12:.3g} TB")
    table.add_column("kind")
    table.add_column("TB", justify="right")
    table.add_column("share", justify="right")
    for kind, nbytes in sorted(store["served"].items(), key=lambda item: -item[1]):
        if nbytes:
            table.add_row(kind.replace("_", " "), f"{nbytes / 1e12:.3g}", _pct(nbytes / total))
    return table


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"
