"""``submit --watch`` / ``job watch`` where stdout is a file or a pipe: a plain line per round, each whole;
on a terminal, the live bar fits 80 columns and cuts nothing with "…"."""

import io
from datetime import UTC, datetime

from rich.console import Console

from gpuflex.cli.watch import watch_job
from gpuflex.protocol.messages import JobInfo


def _job(round_: int, state: str = "running", spent: float = 0.0, workers: int = 2, loss=None) -> JobInfo:
    return JobInfo(
        id="j-1a2b3c4d5e6f",
        name="smol",
        state=state,
        created_at=datetime.now(UTC),
        round=round_,
        rounds=10,
        budget=2.0,
        spent=spent,
        live_workers=workers,
        train_loss=loss,
        val_loss=None if loss is None else loss + 0.046,
    )


POLLS = [
    _job(0, "pending", workers=0),
    _job(0),
    _job(1, spent=0.01, loss=3.9),
    _job(1, spent=0.012, loss=3.9),  # the same round: no new line
    _job(2, spent=0.02, loss=3.773),
    _job(10, "completed", spent=0.042888, workers=0, loss=3.7),
]


class _Polled:
    def __init__(self) -> None:
        self.polls = iter(POLLS)

    def job(self, job_id: str) -> JobInfo:
        return next(self.polls)


def _watch(terminal: bool) -> str:
    console = Console(width=80, file=io.StringIO(), force_terminal=terminal, record=True)
    assert watch_job(_Polled(), "j-1a2b3c4d5e6f", console, poll_s=0).state == "completed"
    return console.export_text()


def test_into_a_file_a_plain_line_per_round_and_the_end_whole():
    lines = _watch(terminal=False).splitlines()
    assert lines == [  # before: nothing until the end, then a cut bar: "round 1… ━ completed … cr 0:…"
        "round 0/10: pending loss -/- (train/val) 0 workers 0.00/2.00 cr",
        "round 0/10: loss -/- (train/val) 2 workers 0.00/2.00 cr",
        "round 1/10: loss 3.900/3.946 (train/val) 2 workers 0.01/2.00 cr",
        "round 2/10: loss 3.773/3.819 (train/val) 2 workers 0.02/2.00 cr",
        "round 10/10: completed loss 3.700/3.746 (train/val) 0 workers 0.042888/2.00 cr",
    ]


def test_on_a_terminal_80_columns_wide_the_live_bar_cuts_nothing():
    text = _watch(terminal=True)
    assert "…" not in text, text
    assert "10/10" in text and "0.042888/2.00 cr" in text, text
