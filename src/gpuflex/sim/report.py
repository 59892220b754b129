"""A simulation's report: one JSON file and one PNG per question, written to ``--out``.

- ``utilization.png``: nodes online and busy over time, and busy ÷ online;
- ``completion_times.png``: how long completed jobs took, from submission to their last round;
- ``goodput.png``: worker-seconds that went into published rounds ÷ worker-seconds leased, so far
  (the report adds how many leases were re-assigned after a node left or died);
- ``cost_vs_cloud.png``: each completed job's cost against the same contributions on an on-demand
  cloud GPU at its list price (``scenario.cloud``): worker-rounds x the round's compute on that GPU
  (``market.pricing.step_seconds``, the market's own step model) x its price;
- ``aggregator_bandwidth.png``: the aggregator bandwidth a model size needs given the measured
  compression ratios (``sim.bandwidth``), when the benchmark's results are there;
- ``data_plane.png``: the coordinator's egress over time with every blob relayed through it and with
  direct transfers, and the object store's (``sim.dataplane``); ``report.json``'s ``data_plane`` holds
  the bytes by kind, the totals and the rates.

``report.json`` holds every number the plots show. Matplotlib draws off-screen (Agg): no display.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpuflex.market.pricing import step_seconds
from gpuflex.protocol.money import to_credits
from gpuflex.sim import bandwidth, dataplane
from gpuflex.sim.engine import Job, Simulation
from gpuflex.sim.scenario import Cloud

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def cloud_cost(job: Job, cloud: Cloud) -> float:
    """What the job's contributions would cost on one on-demand cloud GPU each, at its list price."""
    training = job.spec.training
    step = step_seconds(training, cloud.tflops)
    compute = training.inner_steps * step if step is not None else (training.round_seconds or 0.0)
    if training.round_seconds is not None:
        compute = min(compute, training.round_seconds)
    return job.worker_rounds * compute / 3600 * cloud.price_per_hour


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"count": 0, "mean": None, "p10": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {
        "count": len(values),
        "mean": float(a.mean()),
        **{f"p{q}": float(np.percentile(a, q)) for q in (10, 50, 90, 99)},
    }


def summary(sim: Simulation, wall_s: float) -> dict:
    """The headline numbers: the line ``--json`` prints last."""
    plane = data_plane(sim)
    return {
        "nodes": sim.pop.n,
        "sim_hours": sim.horizon / 3600,
        "wall_s": round(wall_s, 3),
        "events": sim.count.events,
        "coordinator_egress_gbit_s": {
            way: plane["coordinator"][way]["egress_gbit_s"] for way in ("relayed", "direct")
        },
    }


def data_plane(sim: Simulation) -> dict:
    """Bytes and rates of the data plane: what the store serves (and is written), and what the
    coordinator carries when every blob passes through it (``relayed``) and with direct transfers
    (``direct``: control traffic and one call per blob for its URL)."""
    account, horizon, bucket_s = sim.traffic, sim.horizon, sim.traffic.bucket_s
    samples = [(s.t, s.online, s.busy) for s in sim.samples]
    control_in, control_out, calls = dataplane.control_bytes(samples, sim.scenario.network, horizon, bucket_s)
    per_transfer_in, per_transfer_out = dataplane.TRANSFER_CALL_BYTES
    served_by_kind, written_by_kind, transfers = account.by_kind()
    served, written = account.served_series, account.written_series
    spans = [min(bucket_s, horizon - b * bucket_s) for b in range(len(served))]
    # the calls for URLs, spread as the bytes they fetch are
    total_moved = sum(served) + sum(written) or 1.0
    urls = [transfers * (sv + wr) / total_moved for sv, wr in zip(served, written, strict=True)]
    ways = {
        "relayed": (
            [s + c for s, c in zip(served, control_out, strict=True)],
            [w + c for w, c in zip(written, control_in, strict=True)],
        ),
        "direct": (
            [c + u * per_transfer_out for c, u in zip(control_out, urls, strict=True)],
            [c + u * per_transfer_in for c, u in zip(control_in, urls, strict=True)],
        ),
    }
    return {
        "bucket_s": bucket_s,
        "store": {
            "served_bytes": sum(served),
            "written_bytes": sum(written),
            "served": served_by_kind,
            "written": written_by_kind,
            "egress_gbit_s": _rates(served, spans),
            "transfers": transfers,
        },
        "control": {"bytes_in": sum(control_in), "bytes_out": sum(control_out), **calls},
        "coordinator": {
            way: {
                "egress_bytes": sum(out),
                "ingress_bytes": sum(into),
                "carried_bytes": sum(out) + sum(into),
                "egress_gbit_s": _rates(out, spans),
                "ingress_gbit_s": _rates(into, spans),
            }
            for way, (out, into) in ways.items()
        },
        "node_cache": {"hits": account.cache_hits, "bytes_saved": account.cache_saved},
        "deployments": account.deployments,
        "series": [
            {
                "t_h": b * bucket_s / 3600,
                "store_egress_gbit_s": _gbit_s(served[b], spans[b]),
                "relayed_egress_gbit_s": _gbit_s(ways["relayed"][0][b], spans[b]),
                "direct_egress_gbit_s": _gbit_s(ways["direct"][0][b], spans[b]),
            }
            for b in range(len(served))
        ],
    }


def _gbit_s(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / 1e9 / seconds if seconds > 0 else 0.0


def _rates(series: list[float], spans: list[float]) -> dict[str, float]:
    """The mean over the run and the busiest bucket's mean, in Gbit/s."""
    return {
        "mean": _gbit_s(sum(series), sum(spans)),
        "peak": max((_gbit_s(b, s) for b, s in zip(series, spans, strict=True)), default=0.0),
    }


def build(sim: Simulation, wall_s: float, bench_results: Path | None, cpu_s: float | None = None) -> dict:
    jobs = sim.jobs
    completed = [j for j in jobs if j.state == "completed"]
    samples = sim.samples
    util = [s.busy / s.online for s in samples if s.online]
    per_template = {}
    for t, spec in enumerate(sim.templates):
        done = [j for j in completed if j.template == t]
        ratios = [to_credits(j.cost_micro) / c for j in done if (c := cloud_cost(j, sim.scenario.cloud)) > 0]
        per_template[spec.name] = {
            "arrived": sum(j.template == t for j in jobs),
            "completed": len(done),
            "completion_h": _quantiles([(j.finished_at - j.arrived_at) / 3600 for j in done]),
            "cost": _quantiles([to_credits(j.cost_micro) for j in done]),
            "cloud_cost": _quantiles([cloud_cost(j, sim.scenario.cloud) for j in done]),
            "cost_over_cloud": _quantiles(ratios),
        }
    states = {s: sum(j.state == s for j in jobs) for s in ("pending", "running", "completed", "failed")}
    report = {
        **summary(sim, wall_s),
        "cpu_s": None if cpu_s is None else round(cpu_s, 3),  # this process's CPU time for the same span
        "scenario": sim.scenario.name,
        "seed": sim.scenario.seed,
        "core_nodes": sim.pop.n_core,
        "jobs": {"arrived": len(jobs), **states},
        "utilization": {
            "mean": float(np.mean(util)) if util else None,
            "series": [
                {
                    "t_h": s.t / 3600,
                    "online": s.online,
                    "busy": s.busy,
                    "running": s.running_jobs,
                    "waiting": s.waiting_jobs,
                }
                for s in samples
            ],
        },
        "completion_h": _quantiles([(j.finished_at - j.arrived_at) / 3600 for j in completed]),
        "wait_to_start_h": _quantiles([(j.started_at - j.arrived_at) / 3600 for j in jobs if j.started_at]),
        "goodput": {
            "overall": sim.count.useful_worker_s / sim.count.paid_worker_s
            if sim.count.paid_worker_s
            else None,
            "useful_worker_h": sim.count.useful_worker_s / 3600,
            "leased_worker_h": sim.count.paid_worker_s / 3600,
            "reassignments": sum(j.reassignments for j in jobs),
            "crashes_noticed": sim.count.crashes_noticed,
            "leases_granted": sim.count.grants,
        },
        "cost": {
            "cloud": sim.scenario.cloud.model_dump(),
            "per_template": per_template,
        },
        "aggregator_bandwidth": _bandwidth(sim, bench_results),
        "data_plane": data_plane(sim),
    }
    return report


def _bandwidth(sim: Simulation, path: Path | None) -> dict:
    link = sim.scenario.aggregator_link
    if path is None or not path.exists():
        return {"source": str(path), "rows": [], "note": "no diloco_vs_ddp.py results at this path"}
    codecs = bandwidth.measured_codecs(path)
    return {
        "source": str(path),
        "rows": bandwidth.table(codecs, list(link.model_params), link.workers, link.round_minutes * 60),
    }


def write(
    sim: Simulation, wall_s: float, out: Path, bench_results: Path | None, *, cpu_s: float | None = None
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = build(sim, wall_s, bench_results, cpu_s)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    _plot_utilization(report, out / "utilization.png")
    _plot_completion(sim, out / "completion_times.png")
    _plot_goodput(sim, out / "goodput.png")
    _plot_cost(report, out / "cost_vs_cloud.png")
    if report["aggregator_bandwidth"]["rows"]:
        _plot_bandwidth(report, out / "aggregator_bandwidth.png")
    _plot_data_plane(report, out / "data_plane.png")
    return report


def _figure(rows: int = 1, *, size: tuple[float, float] = (8, 4.5), **kw):
    """Matplotlib is imported here, not at the top: every ``gpuflex`` command imports this module
    and would pay its import (0.4 s) for nothing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, **kw)


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_utilization(report: dict, path: Path) -> None:
    series = report["utilization"]["series"]
    t = [s["t_h"] for s in series]
    fig, (top, bottom) = _figure(2, size=(8, 6), sharex=True)
    top.plot(t, [s["online"] for s in series], label="online")
    top.plot(t, [s["busy"] for s in series], label="leased")
    top.set_ylabel("nodes")
    top.legend()
    bottom.plot(t, [s["busy"] / s["online"] if s["online"] else 0 for s in series])
    bottom.set_ylabel("utilization (leased ÷ online)")
    bottom.set_xlabel("hours")
    bottom.set_ylim(0, 1)
    fig.suptitle(f"{report['scenario']}: {report['nodes']:,} nodes")
    _save(fig, path)


def _plot_completion(sim: Simulation, path: Path) -> None:
    fig, ax = _figure()
    for t, spec in enumerate(sim.templates):
        hours = [
            (j.finished_at - j.arrived_at) / 3600
            for j in sim.jobs
            if j.template == t and j.state == "completed"
        ]
        if hours:
            ax.hist(hours, bins=40, alpha=0.6, label=f"{spec.name} ({len(hours)})")
    ax.set_xlabel("hours from submission to the last round")
    ax.set_ylabel("completed jobs")
    ax.legend()
    _save(fig, path)


def _plot_goodput(sim: Simulation, path: Path) -> None:
    """Cumulative: rounds are credited when a stretch of them ends, so short windows would jitter."""
    s = [b for b in sim.samples if b.paid_worker_s > 0]
    fig, ax = _figure(size=(8, 4))
    ax.plot([b.t / 3600 for b in s], [b.useful_worker_s / b.paid_worker_s for b in s])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("hours")
    ax.set_ylabel("goodput so far (useful ÷ leased)")
    ax.set_title("goodput under churn: worker time in published rounds ÷ worker time leased")
    _save(fig, path)


def _plot_cost(report: dict, path: Path) -> None:
    names, ours, cloud = [], [], []
    for name, row in report["cost"]["per_template"].items():
        if row["completed"]:
            names.append(name)
            ours.append(row["cost"]["p50"])
            cloud.append(row["cloud_cost"]["p50"])
    fig, ax = _figure()
    x = np.arange(len(names))
    ax.bar(x - 0.2, ours, 0.4, label="GPUFlex (simulated, median)")
    ax.bar(x + 0.2, cloud, 0.4, label=f"on-demand: {report['cost']['cloud']['name']}")
    ax.set_xticks(x, names)
    ax.set_ylabel("credits (USD) per completed job")
    ax.set_yscale("log")
    ax.legend()
    _save(fig, path)


def _plot_bandwidth(report: dict, path: Path) -> None:
    rows = report["aggregator_bandwidth"]["rows"]
    fig, ax = _figure()
    for codec in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == codec]
        ax.plot([r["params"] for r in mine], [r["gbit_per_s"] for r in mine], marker="o", label=codec)
    r0 = rows[0]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model parameters")
    ax.set_ylabel("aggregator bandwidth, Gbit/s (in + out)")
    ax.set_title(f"{r0['workers']} workers, rounds of {r0['round_s'] / 60:g} min")
    ax.legend()
    _save(fig, path)


def _plot_data_plane(report: dict, path: Path) -> None:
    series = report["data_plane"]["series"]
    fig, ax = _figure()
    t = [b["t_h"] for b in series]
    for key, label, style in (  # relayed, the coordinator's egress lies just above the store's: dashed
        ("store_egress_gbit_s", "object store", "-"),
        ("relayed_egress_gbit_s", "coordinator, every blob relayed", "--"),
        ("direct_egress_gbit_s", "coordinator, direct transfers", "-"),
    ):
        ax.plot(t, [b[key] for b in series], style, label=label)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("hours")
    ax.set_ylabel(f"egress, Gbit/s (mean over {report['data_plane']['bucket_s'] / 60:g} min)")
    ax.legend()
    _save(fig, path)
