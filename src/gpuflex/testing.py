"""Tools the tests use to run real parts in-process: the coordinator served on loopback, a clock to move.

They ship with the library (as torchft's and hivemind's fault injectors do) so any test suite of
GPUFlex, or of a project built on it, can stand up a real coordinator without mocking it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from gpuflex.localnet import free_port


class Clock:
    """Real time plus an offset a test can advance (signed requests stay within the allowed skew)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a loopback port, in a thread of this process; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the coordinator failed to start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
