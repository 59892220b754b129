"""A whole GPUFlex network on this machine: a coordinator and provider agents as child processes.

The demo runs on it, and so do the integration tests: real processes on loopback, nothing mocked.
Every process logs to ``<root>/logs/<name>.log``; ``stop()`` (or leaving the ``with`` block) sends
SIGTERM, waits, then SIGKILLs, so nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpuflex.client.http import trusting
from gpuflex.errors import ServiceError

CORE_TOKEN = "localnet-core-token"


@dataclass(frozen=True)
class Tls:
    """HTTPS for the coordinator: its certificate and key, and the CA every process verifies it with."""

    cert: Path
    key: Path
    ca: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalNetwork:
    def __init__(
        self,
        root: Path,
        *,
        database_url: str | None = None,
        settings: dict[str, str] | None = None,
        tls: Tls | None = None,
    ):
        self.root = Path(root)
        self.database_url = database_url
        self.settings = settings or {}
        self.tls = tls
        self.url = ""
        self.coordinator: subprocess.Popen | None = None
        self.replicas: dict[str, subprocess.Popen] = {}  # more coordinators on the same database, by URL
        self.agents: dict[str, subprocess.Popen] = {}

    @property
    def database(self) -> str:
        """The coordinator's database URL (SQLite in its data dir unless one was given)."""
        return self.database_url or f"sqlite:///{self.root / 'coordinator' / 'gpuflex.db'}"

    def __enter__(self) -> LocalNetwork:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log_dir = self.root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GPUFLEX_CORE_TOKEN": CORE_TOKEN, **self.settings}
        env.pop("GPUFLEX_TOKEN", None)
        trust = ["--ca", str(self.tls.ca)] if self.tls else []
        with open(log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "gpuflex", *trust, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def log_tail(self, name: str, n_bytes: int = 3000) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_bytes()[-n_bytes:].decode(errors="replace") if path.exists() else ""

    def start_coordinator(self, *, port: int | None = None, timeout_s: float = 60) -> str:
        self.url, self.coordinator = self._serve("coordinator", port, timeout_s)
        return self.url

    def start_replica(self, *, timeout_s: float = 60) -> str:
        """Another coordinator on the same database and blob directory (PostgreSQL); returns its URL."""
        url, process = self._serve(f"coordinator-{len(self.replicas) + 2}", None, timeout_s)
        self.replicas[url] = process
        return url

    def _serve(self, name: str, port: int | None, timeout_s: float) -> tuple[str, subprocess.Popen]:
        port = port or free_port()
        args = ["coordinator", "serve", "--port", str(port), "--data-dir", str(self.root / "coordinator")]
        if self.database_url:
            args += ["--database-url", self.database_url]
        if self.tls:
            args += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        process = self._spawn(name, args)
        url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        self._wait_healthy(name, url, process, timeout_s)
        return url, process

    def _wait_healthy(self, name: str, url: str, process: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServiceError(f"{name} exited at start:\n{self.log_tail(name)}")
            try:
                if httpx.get(
                    f"{url}/healthz", timeout=1, verify=trusting(self.tls and self.tls.ca)
                ).is_success:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise ServiceError(f"{name} did not answer within {timeout_s:.0f}s")

    def start_agent(
        self,
        name: str,
        *,
        price: float,
        core: bool = False,
        extra: list[str] | None = None,
        url: str | None = None,
    ) -> None:
        """A provider agent; ``url`` picks a coordinator replica (default: the first coordinator)."""
        args = [
            "provider",
            "start",
            "--name",
            name,
            "--price",
            str(price),
            "--url",
            url or self.url,
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

    def stop_replica(self, url: str, sig: int = signal.SIGKILL) -> None:
        """Stop the coordinator replica at ``url`` (``kill -9`` by default, as when its machine dies)."""
        _stop(self.replicas.pop(url), sig, 15)

    def stop_coordinator(self, sig: int = signal.SIGTERM) -> None:
        if self.coordinator is not None:
            _stop(self.coordinator, sig, 15)
            self.coordinator = None

    def restart_coordinator(self, sig: int = signal.SIGKILL, *, down_s: float = 0.0) -> None:
        """Stop the coordinator (``kill -9`` by default), stay down ``down_s``, start it on the same port."""
        port = int(self.url.rsplit(":", 1)[1])
        self.stop_coordinator(sig)
        time.sleep(down_s)
        self.start_coordinator(port=port)

    def kill_agent(self, name: str, *, with_tasks: bool = True) -> list[int]:
        """``kill -9`` the agent and, as when a machine dies, every task it runs (``with_tasks=False``:
        the agent alone, as when it crashes). Returns the pids of the processes it ran."""
        process = self.agents.pop(name)
        below = descendants(process.pid)
        if with_tasks:
            _signal_tree(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait()
        return below

    def pause_agent(self, name: str) -> None:
        """Freeze the node (its agent and tasks), as a suspended VM or a cut network cable looks."""
        _signal_tree(self.agents[name].pid, signal.SIGSTOP)

    def resume_agent(self, name: str) -> None:
        _signal_tree(self.agents[name].pid, signal.SIGCONT)

    def stop(self) -> None:
        for name in list(self.agents):
            _signal_tree(self.agents[name].pid, signal.SIGCONT)  # a paused agent can't act on SIGTERM
            self.agents[name].send_signal(signal.SIGTERM)
        for name in list(self.agents):
            self.stop_agent(name)
        for process in self.replicas.values():
            _stop(process, signal.SIGTERM, 15)
        self.replicas.clear()
        self.stop_coordinator()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before children (Linux: read from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def _signal_tree(pid: int, sig: int) -> None:
    """Signal a process and all its descendants (a task runs in its own process group)."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sig)


def _stop(process: subprocess.Popen, sig: int, timeout_s: float) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
