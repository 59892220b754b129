"""The entry point of a task: what the agent's subprocess calls with its config and transport.

It dispatches on the task's role and returns the run's summary as a plain dict (JSON-ready),
for the agent to report. Process-wide choices (``torch.set_num_threads``, signal handling)
belong to the caller, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from gpuflex.data.fetch import ShardReader
from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import TaskConfig
from gpuflex.train.aggregator import run_aggregator
from gpuflex.train.transport import Transport
from gpuflex.train.worker import run_worker


def run_task(
    config: TaskConfig,
    transport: Transport,
    should_stop: Callable[[], bool] = lambda: False,
    *,
    poll_interval_s: float = 0.2,
    after_step: Callable[[float], None] | None = None,
    reader: ShardReader | None = None,
) -> dict[str, Any]:
    """Run the task as a worker or as the aggregator until the job finishes or ``should_stop``.

    ``after_step`` is passed to a worker, ``reader`` (a prepared dataset's shards) to either (see
    ``run_worker``).
    """
    common: dict[str, Any] = {
        "poll_interval_s": poll_interval_s,
        "should_stop": should_stop,
        "reader": reader,
    }
    if config.role == "worker":
        summary: Any = run_worker(config, transport, after_step=after_step, **common)
    elif config.role == "aggregator":
        summary = run_aggregator(config, transport, **common)
    else:
        raise BadRequest(f"unknown task role {config.role!r}")
    return {"role": config.role, **asdict(summary)}
