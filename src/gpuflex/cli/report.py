"""``gpuflex job report``: a job's loss curve as a PNG, and its cost table (printed, and CSV beside it).

gpuflex job report JOB_ID -o report.png      # writes report.png and report.csv
"""

from __future__ import annotations

import csv
from pathlib import Path

from rich.console import Group
from rich.text import Text

from gpuflex.cli.output import credits, table
from gpuflex.protocol.messages import JobDetail

# credits: what the node was paid (as the ledger settles it); metered: its lease time at its price, more
# than credits only when the budget ran out
CSV_FIELDS = ("node_id", "name", "kind", "seconds", "credits", "share", "metered")
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
            "metered": c.cost if c.metered is None else round(c.metered, 6),
        }
        for c in job.costs
    ]


def write_csv(job: JobDetail, output: Path) -> None:
    with output.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(cost_rows(job))


def cost_table(job: JobDetail) -> Group:
    """What each node cost, as the ledger settles it (``credits`` add up to ``spent``), and below the
    table what was spent of the budget, per round, and, when the budget ran out before the leases'
    meter stopped, what they metered."""
    costs = table(
        "node", "name", "kind", "seconds", "credits", "share", ids=["node"], title=f"cost of {job.name}"
    )
    rows = cost_rows(job)
    for row in rows:
        costs.add_row(
            str(row["node_id"]),
            str(row["name"]),
            str(row["kind"]),
            f"{row['seconds']:.1f}",
            f"{row['credits']:.6f}",
            f"{row['share']:.0%}",
        )
    per_round = f"; {credits(job.spent / job.round)} per round" if job.round else ""
    notes = [f"spent {credits(job.spent)} of a {credits(job.budget)} budget{per_round}"]
    metered = sum(float(row["metered"]) for row in rows)
    if round(metered, 6) > round(job.spent, 6):
        notes.append(
            f"the budget ran out: the leases metered {metered:.6f} credits, and each node was paid its "
            "metered cost cut in proportion to fit the budget (credits; the CSV and --json have both)"
        )
    return Group(costs, *(Text(note) for note in notes))


def write_report(job: JobDetail, output: Path) -> Path:
    """Write the PNG at ``output`` and the cost CSV beside it; returns the CSV's path."""
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_losses(job, output)
    table_path = output.with_suffix(".csv")
    write_csv(job, table_path)
    return table_path
