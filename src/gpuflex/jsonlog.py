"""Log lines for people (``text``) or for machines (``json``: one object per line), with ids as fields.

Callers name the ids a line is about with ``extra``; every line of a process can carry fixed fields
(an agent's ``node_id``) given once to ``configure``::

    log.info("lease granted", extra={"job_id": job.id, "node_id": node.id, "lease_id": lease.id})
    # {"ts": "2026-11-02T10:00:00.123Z", "level": "info", "logger": "gpuflex.coordinator",
    #  "msg": "lease granted", "job_id": "j-…", "node_id": "n-…", "lease_id": "l-…"}

This module imports nothing of GPUFlex, so every process (coordinator, agent, task) may use it.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]

# The ``extra`` keys that become fields; anything else passed in ``extra`` stays off the line.
FIELDS = (
    "job_id",
    "node_id",
    "lease_id",
    "task_id",
    "round",
    "role",
    "kind",
    "state",
    "outcome",
    "method",
    "route",
    "status",
    "duration_ms",
)
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET = ("httpx", "httpcore")  # a line per request (every heartbeat) drowns the lines that matter


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: getattr(record, k) for k in FIELDS if getattr(record, k, None) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the fixed fields and the ids."""

    def __init__(self, static: dict[str, object] | None = None):
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        at = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, object] = {
            "ts": at.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
            **_fields(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The usual text line, with the ids appended as ``key=value``."""

    def __init__(self, static: dict[str, object] | None = None):
        super().__init__(TEXT_FORMAT)
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        pairs = {**self.static, **_fields(record)}
        return text + "".join(f" {k}={v}" for k, v in pairs.items()) if pairs else text


def configure(fmt: LogFormat = "text", *, level: int = logging.INFO, **static: object) -> None:
    """Send every log record of this process to stderr in ``fmt``; ``static`` fields go on every line."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(static) if fmt == "json" else TextFormatter(static))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in QUIET:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
