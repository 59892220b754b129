"""A live Rich view of a running job: round, losses, live workers and credits spent."""

from __future__ import annotations

import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from gpuflex.cli.output import credits
from gpuflex.client import Client
from gpuflex.protocol.messages import JobInfo

TERMINAL = ("completed", "failed", "cancelled", "out_of_budget")
# how `submit --watch` and `job watch` exit, so a script can tell how the job ended (README: "Use it");
# Ctrl-C exits 130
EXIT_CODES = {"completed": 0, "failed": 3, "cancelled": 4, "out_of_budget": 5}


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _describe(job: JobInfo) -> str:
    state = "" if job.state == "running" else f"{job.state} "
    return (
        f"{state}loss {_loss(job.train_loss)}/{_loss(job.val_loss)} (train/val) "
        f"{job.live_workers} workers {credits(job.spent)}/{credits(job.budget)} cr"
    )


def watch_job(
    client: Client, job_id: str, console: Console, *, poll_s: float = 0.5, timeout_s: float | None = None
) -> JobInfo:
    """Follow a job until it ends (or ``timeout_s`` passes); returns its last state.

    On a terminal, a live bar. Elsewhere (a file, a pipe, a CI log) a live view prints only its last frame,
    so one plain line per round or change of state instead, each whole however long."""
    job = client.job(job_id)
    polls = _polls(client, job, poll_s, timeout_s)
    if not console.is_terminal:
        shown = None
        for job in polls:
            if (job.round, job.state) != shown:
                shown = (job.round, job.state)
                line = f"round {job.round}/{job.rounds}: {_describe(job)}"
                console.print(line, soft_wrap=True, markup=False, highlight=False)
        return job
    columns = (  # the description wraps between words, below the bar, rather than be cut at the edge
        TextColumn("[bold]round", table_column=Column(no_wrap=True)),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        BarColumn(bar_width=16),
        TextColumn("{task.description}", table_column=Column(overflow="fold")),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(_describe(job), total=job.rounds, completed=job.round)
        for job in polls:
            progress.update(bar, completed=job.round, description=_describe(job))
    return job


def _polls(client: Client, job: JobInfo, poll_s: float, timeout_s: float | None) -> Iterator[JobInfo]:
    """``job``, then its state every ``poll_s`` until it ends or ``timeout_s`` passes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    yield job
    while job.state not in TERMINAL and (deadline is None or time.monotonic() < deadline):
        time.sleep(poll_s)
        job = client.job(job.id)
        yield job
