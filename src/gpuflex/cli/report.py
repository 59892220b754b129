"""``gpuflex job report``: a job's loss curve as a PNG, and its cost table (printed, and CSV beside it).

gpuflex job report JOB_ID -o report.png      # writes report.png and report.csv
"""

from __future__ import annotations

import csv
from pathlib import Path

from rich.table import Table

from gpuflex.protocol.messages import JobDetail

CSV_FIELDS = ("node_id", "name", "kind", "seconds", "credits", "share")
SERIES = (("val_loss", "validation", "o-"), ("train_loss", "train (mean of workers)", "s--"))


def plot_losses(job: JobDetail, output: Path) -> None:
    """Validation and mean train loss per round, drawn off-screen (Agg) to a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, label, style in (
        ("val_loss", "validation", "o-"),
        ("train_loss", "train (mean of workers)", "s--"),
    ):
        points = [(r.round, getattr(r, key)) for r in job.rounds_log if getattr(r, key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label, markersize=4, linewidth=1.8)
    ax.set_xlabel("round")
    ax.set_ylabel("loss")
    ax.set_title(f"{job.name} ({job.id}): {job.state}, round {job.round}/{job.rounds}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no round published yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(output)


def cost_rows(job: JobDetail) -> list[dict[str, object]]:
    total = sum(c.cost for c in job.costs)
    return [
        {
            "node_id": c.node_id,
            "name": c.name,
            "kind": c.kind,
            "seconds": round(c.seconds, 1),
            "credits": round(c.cost, 6),
            "share": round(c.cost / total, 4) if total else 0.0,
        }
        for c in job.costs
    ]


def write_csv(job: JobDetail, output: Path) -> None:
    with output.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(cost_rows(job))


def cost_table(job: JobDetail) -> Table:
    table = Table("node", "name", "kind", "seconds", "credits", "share", title=f"cost of {job.name}")
    for row in cost_rows(job):
        table.add_row(
            str(row["node_id"]),
            str(row["name"]),
            str(row["kind"]),
            f"{row['seconds']:.1f}",
            f"{row['credits']:.6f}",
            f"{row['share']:.0%}",
        )
    per_round = f"; {job.spent / job.round:.6f} per round" if job.round else ""
    table.caption = f"spent {job.spent:.6f} of {job.budget:.2f} credits{per_round}"
    return table


def write_report(job: JobDetail, output: Path) -> Path:
    """Write the PNG at ``output`` and the cost CSV beside it; returns the CSV's path."""
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_losses(job, output)
    table_path = output.with_suffix(".csv")
    write_csv(job, table_path)
    return table_path
