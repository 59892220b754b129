"""The benchmarks' own logic, tested on small inputs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[2] / "bench"


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (with ``bench/`` on the path while it imports, since the
    scripts import their siblings by name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
