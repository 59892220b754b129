"""Runs a task's code in a subprocess the agent can bound, watch and kill.

Owns the isolation a task gets on a provider's machine: a private work directory (mode 0700), an
environment scrubbed down to an allowlist (the agent's secrets, its HOME and cloud credentials never
reach task code), a filesystem view confined by Landlock to the system, the Python installation and
its own work directory (``confine``: the agent's key, other tasks' files and anything else of the
agent's user are out of reach), resource limits, its own session (so the task and every process it
spawns form one process group that can be signalled as a whole), and a log file that collects its
stdout and stderr.

The limits and Landlock are applied by a small wrapper, ``python -I -S confine.py … <task argv>``, that
replaces itself with the task, rather than by ``preexec_fn``: the agent is threaded (heartbeats,
uploads, logging), and running Python between fork and exec in a threaded parent can deadlock on a lock
another thread held at fork time. The wrapper costs one short interpreter start; ``-I`` keeps the work
directory, which task code controls, off its import path. ``start_new_session`` is done by subprocess
itself without Python code after fork, so it is safe.

What this does not stop (docs/architecture.md, "Security and abuse"): the task runs as the agent's
Unix user, so it may signal the agent's other processes and use the network as the agent can; a
kernel exploit defeats all of it. Hostile code beyond that needs a container or VM around the agent.
"""

from __future__ import annotations

import glob
import os
import resource
import signal
import site
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuflex.agent import confine

MB = 2**20
ENV_ALLOWLIST = ("PATH", "LANG", "LC_ALL", "TZ")
CPU_KILL_GRACE_S = 5  # between SIGXCPU at the soft CPU limit and SIGKILL at the hard one

# What every task may read (and execute): the system's programs and libraries, a few files of /etc that
# name resolution and TLS need, its own /proc entry (/proc/self resolves to the wrapper's pid, which the
# task keeps across exec), CPU and memory facts. Never the agent's data dir, /tmp or other processes.
SYSTEM_READ_ONLY = (
    "/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/ssl",
    "/etc/ca-certificates", "/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/host.conf",
    "/etc/gai.conf", "/etc/passwd", "/etc/group",
    "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/sys",
    "/dev/urandom", "/dev/random", "/dev/zero",
)  # fmt: skip
DEVICES_READ_WRITE = ("/dev/null", "/dev/shm", "/dev/dri", *glob.glob("/dev/nvidia*"))


def python_read_only() -> list[str]:
    """Where this interpreter, its packages and gpuflex itself live: what ``python -m gpuflex…`` reads."""
    gpuflex_root = Path(__file__).resolve().parents[2]  # src/ of a checkout, or site-packages
    return sorted({sys.base_prefix, sys.prefix, sys.exec_prefix, *site.getsitepackages(), str(gpuflex_root)})


@dataclass(frozen=True)
class Limits:
    """Resource limits of one task; None keeps the agent's own limit. Core dumps are always off.

    ``memory_mb`` bounds virtual address space (RLIMIT_AS), not resident memory. torch on CPU maps far
    more than it touches (a thread pool and malloc arenas per thread: about 0.8 GB to multiply two
    1000x1000 matrices, 2.7 GB with 64 threads), so 8 GB leaves it room while stopping a runaway. The
    CUDA driver reserves tens of GB of address space up front, so GPU tasks need ``memory_mb=None``.
    ``max_file_mb`` also caps the task's log, which the task itself writes.
    """

    memory_mb: int | None = 8192
    cpu_seconds: int | None = None
    max_file_mb: int = 1024
    max_open_files: int = 1024

    def __post_init__(self) -> None:
        for name in ("memory_mb", "cpu_seconds", "max_file_mb", "max_open_files"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {value}")

    def rlimits(self) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) triples, hard limits capped at what this process may grant."""
        wanted = [
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_FSIZE, self.max_file_mb * MB, self.max_file_mb * MB),
            (resource.RLIMIT_NOFILE, self.max_open_files, self.max_open_files),
        ]
        if self.memory_mb is not None:
            wanted.append((resource.RLIMIT_AS, self.memory_mb * MB, self.memory_mb * MB))
        if self.cpu_seconds is not None:
            wanted.append((resource.RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds + CPU_KILL_GRACE_S))
        return [_within_hard_limit(res, soft, hard) for res, soft, hard in wanted]


def _within_hard_limit(res: int, soft: int, hard: int) -> tuple[int, int, int]:
    _, current_hard = resource.getrlimit(res)
    if current_hard != resource.RLIM_INFINITY:
        hard = min(hard, current_hard)
    return res, min(soft, hard), hard


def scrubbed_env(extra: Mapping[str, str], parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted variables of ``parent`` (default: this process's environment), then ``extra``."""
    source = os.environ if parent is None else parent
    env = {name: source[name] for name in ENV_ALLOWLIST if name in source}
    env.setdefault("PATH", os.defpath)
    env.update(extra)
    return env


class TaskProcess:
    """A running task: the leader of its own process group, logging to ``log_path``."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path):
        self._popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        """The exit code once the task has ended (negative: killed by that signal), else None."""
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the task ends; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        return self._popen.wait(timeout)

    def terminate(self, grace_s: float = 10) -> None:
        """SIGTERM the whole group, give it ``grace_s`` to exit, then SIGKILL whatever is left."""
        if self._signal_group(signal.SIGTERM):
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self._popen.poll()  # reap the leader, or its zombie keeps the group "alive"
                if not self._signal_group(0):
                    break
                time.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process of the group and reap the leader."""
        self._signal_group(signal.SIGKILL)
        self._popen.wait()

    def tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the log (a character cut at the start shows as U+FFFD)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - n_bytes))
                return log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the group; False when no process of it is left."""
        try:
            os.killpg(self._popen.pid, sig)
        except ProcessLookupError:
            return False
        return True


def start_task(
    argv: list[str],
    *,
    workdir: Path,
    env_extra: Mapping[str, str],
    limits: Limits,
    log_path: Path,
    shared: Sequence[Path] = (),
    read_only: Sequence[Path] = (),
) -> TaskProcess:
    """Start ``argv`` in ``workdir`` (created 0700), under ``limits``, appending its output to ``log_path``.

    The task's environment is the allowlist, HOME and TMPDIR set to ``workdir``, then ``env_extra``
    (which wins). The task may read only what ``SYSTEM_READ_ONLY`` and ``python_read_only`` name, and
    write only beneath ``workdir``, the ``shared`` directories (the agent's shard cache) and a few devices;
    ``read_only`` adds directories it may read (a federated worker's private dataset).
    """
    if not argv:
        raise ValueError("argv must name a program")
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    workdir.chmod(0o700)
    env = scrubbed_env({"HOME": str(workdir), "TMPDIR": str(workdir), **env_extra})
    spec = ",".join(f"{res}:{soft}:{hard}" for res, soft, hard in limits.rlimits())
    lc_ctype = "keep" if "LC_CTYPE" in env else "drop"
    readable = os.pathsep.join(
        [*SYSTEM_READ_ONLY, *python_read_only(), *(str(d.resolve()) for d in read_only)]
    )
    read_write = os.pathsep.join(
        [str(workdir.resolve()), *(str(d.resolve()) for d in shared), *DEVICES_READ_WRITE]
    )
    wrapped = [sys.executable, "-I", "-S", confine.__file__, spec, lc_ctype, readable, read_write, *argv]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        popen = subprocess.Popen(
            wrapped,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(fd)  # the child holds its own copy
    return TaskProcess(popen, log_path)
