"""A whole GPUFlex network on this machine: a coordinator and provider agents as child processes.

The demo runs on it, and so do the integration tests: real processes on loopback, nothing mocked.
Every process logs to ``<root>/logs/<name>.log``; ``stop()`` (or leaving the ``with`` block) sends
SIGTERM, waits, then SIGKILLs, so nothing is left running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gpuflex.errors import ServiceError

CORE_TOKEN = "localnet-core-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalNetwork:
    def __init__(
        self, root: Path, *, database_url: str | None = None, settings: dict[str, str] | None = None
    ):
        self.root = Path(root)
        self.database_url = database_url
        self.settings = settings or {}
        self.url = ""
        self.coordinator: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> LocalNetwork:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log_dir = self.root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GPUFLEX_CORE_TOKEN": CORE_TOKEN, **self.settings}
        env.pop("GPUFLEX_TOKEN", None)
        with open(log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "gpuflex", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def log_tail(self, name: str, n_bytes: int = 3000) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_bytes()[-n_bytes:].decode(errors="replace") if path.exists() else ""

    def start_coordinator(self, *, port: int | None = None, timeout_s: float = 60) -> str:
        port = port or free_port()
        args = ["coordinator", "serve", "--port", str(port), "--data-dir", str(self.root / "coordinator")]
        if self.database_url:
            args += ["--database-url", self.database_url]
        self.coordinator = self._spawn("coordinator", args)
        self.url = f"http://127.0.0.1:{port}"
        self._wait_healthy(timeout_s)
        return self.url

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.coordinator.poll() is not None:
                raise ServiceError(f"the coordinator exited at start:\n{self.log_tail('coordinator')}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).is_success:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise ServiceError(f"the coordinator did not answer within {timeout_s:.0f}s")

    def start_agent(
        self, name: str, *, price: float, core: bool = False, extra: list[str] | None = None
    ) -> None:
        args = [
            "provider",
            "start",
            "--name",
            name,
            "--price",
            str(price),
            "--url",
            self.url,
            "--data-dir",
            str(self.root / "agents" / name),
            "--threads",
            "1",  # every process shares this one machine
            *(["--core"] if core else []),
            *(extra or []),
        ]
        self.agents[name] = self._spawn(name, args)

    def stop_agent(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        _stop(self.agents.pop(name), sig, timeout_s)

    def stop_coordinator(self, sig: int = signal.SIGTERM) -> None:
        if self.coordinator is not None:
            _stop(self.coordinator, sig, 15)
            self.coordinator = None

    def stop(self) -> None:
        for name in list(self.agents):
            self.agents[name].send_signal(signal.SIGTERM)
        for name in list(self.agents):
            self.stop_agent(name)
        self.stop_coordinator()


def _stop(process: subprocess.Popen, sig: int, timeout_s: float) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
