"""The terminal views of a job: ``job watch`` (live Rich view) and ``job report`` (PNG + cost table)."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

from rich.console import Console

from gpuflex.cli.report import cost_table, write_report
from gpuflex.cli.watch import watch_job


def test_watch_shows_round_losses_workers_and_spend(running_job):
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=False)
    job = watch_job(running_job.alice, running_job.job_id, console, poll_s=0.01, timeout_s=0.05)
    text = out.getvalue()
    assert job.state == "running"
    assert "round" in text and "1/5" in text
    assert "loss 4.950/4.500 (train/val)" in text
    assert "2 workers" in text and " cr" in text


def test_report_writes_a_png_loss_curve_and_a_cost_table(web, running_job, tmp_path):
    web.clock.advance(10)  # ten seconds of metered lease time on every node
    job = running_job.alice.job(running_job.job_id)
    png = tmp_path / "out" / "report.png"
    table_path = write_report(job, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = list(csv.DictReader(table_path.open()))
    assert table_path == tmp_path / "out" / "report.csv"
    assert {r["name"] for r in rows} == {"core-1", "box-0", "box-1"}
    assert abs(sum(float(r["credits"]) for r in rows) - job.spent) < 1e-5
    assert abs(sum(float(r["share"]) for r in rows) - 1) < 1e-3
    printed = io.StringIO()
    Console(file=printed, width=160).print(cost_table(job))
    assert "core-1" in printed.getvalue() and "per round" in printed.getvalue()


def test_provider_dashboard_without_a_node_key_says_where_it_looked(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpuflex", "provider", "dashboard", "--data-dir", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"no node key at {tmp_path / 'nowhere' / 'node.key'}" in result.stderr
