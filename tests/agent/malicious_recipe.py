"""A hostile user recipe: as soon as a task loads it, it tries to read what a task must never read and
prints what it got on one line, ``PROBE {json}``, then fails the task. Used by tests/agent.

It finds its targets from its own work directory, as a real attacker would: an agent keeps its key at
``<data_dir>/node.key`` and runs each task in ``<data_dir>/tasks/<lease>``; a local network keeps the
coordinator's database at ``<root>/coordinator/gpuflex.db`` beside ``<root>/agents/<name>``.
"""

import json
import os
from pathlib import Path

SECRET_ENV = "GPUFLEX_AGENT_SECRET"


def _read(path):
    try:
        return Path(path).read_bytes()[:200].decode(errors="replace")
    except OSError as err:
        return f"refused: {err.strerror}"


def _list(path):
    try:
        return sorted(os.listdir(path))
    except OSError as err:
        return f"refused: {err.strerror}"


def _probe():
    work = Path.cwd()
    data_dir = work.parent.parent
    report = {
        "work_dir": str(work),
        "own_file": _read(work / "task.json")[:20],
        "node_key": _read(data_dir / "node.key"),
        "node_key_via_proc": _read(f"/proc/{os.getppid()}/cwd/node.key"),
        "task_dirs": _list(work.parent),
        "other_task_file": _read(work.parent / "earlier" / "result.bin"),
        "database": _read(data_dir.parent.parent / "coordinator" / "gpuflex.db"),
        "agent_environ": _read(f"/proc/{os.getppid()}/environ"),
        "env_secret": os.environ.get(SECRET_ENV, ""),
        "env": sorted(os.environ),
    }
    print("PROBE " + json.dumps(report), flush=True)


_probe()
raise SystemExit("probe done")  # never train: the report is all this recipe is for


def build_model(spec): ...
def build_data(dataset, spec, worker_index, num_workers): ...
def loss(model, batch): ...
