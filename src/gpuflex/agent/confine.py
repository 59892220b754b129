"""The exec wrapper of a task: resource limits, then Landlock, then the task itself in this process.

    python -I -S confine.py <res:soft:hard,...> <keep|drop> <read-only paths> <read-write paths> <argv...>

The agent's sandbox runs this file by path with ``-I -S`` (no site, no work directory on the path), so
it imports nothing but the standard library, and execs the task as soon as it is done. It is a file
of its own, not code run between fork and exec, because the agent is threaded (see ``sandbox``).

Landlock (Linux 5.13+, unprivileged) confines the filesystem view of this process and of everything
it execs or forks: after ``restrict_self`` it may read and execute only beneath the read-only paths,
and read and write only beneath the read-write ones. The agent's key, other tasks' directories and a
coordinator database beside the agent are outside both, so they cannot be opened, whatever the task
does. Path lists are joined with NUL-free ``os.pathsep``. On a kernel without Landlock the task runs
unconfined and says so on its log's first line.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on every Linux architecture
_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FILE_ONLY = _EXECUTE | _WRITE_FILE | _READ_FILE | (1 << 14) | (1 << 15)  # + truncate, ioctl on devices
_READ = _EXECUTE | _READ_FILE | _READ_DIR


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock."""
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, version)


def _handled(abi: int) -> int:
    """Every filesystem right this ABI knows: what is not granted below is then denied."""
    rights = (1 << 13) - 1
    for version, right in ((2, 1 << 13), (3, 1 << 14), (5, 1 << 15)):  # refer, truncate, ioctl_dev
        if abi >= version:
            rights |= right
    return rights


def restrict(read_only: list[str], read_write: list[str]) -> bool:
    """Confine this process (and what it execs) to these paths; False if the kernel has no Landlock."""
    abi = abi_version()
    if abi < 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    handled = _handled(abi)
    attr = ctypes.c_uint64(handled)
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for paths, rights in ((read_only, _READ), (read_write, handled)):
            for path in paths:
                _allow(libc, ruleset, path, rights & handled)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return True


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine does not have
    try:
        if not os.path.isdir(path):
            rights &= _FILE_ONLY
        rule = _PathBeneath(rights, fd)
        if libc.syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    limits, lc_ctype, read_only, read_write, *task = argv
    for item in limits.split(","):
        res, soft, hard = (int(x) for x in item.split(":"))
        resource.setrlimit(res, (soft, hard))
    if not restrict(read_only.split(os.pathsep), read_write.split(os.pathsep)):
        sys.stderr.write("sandbox: this kernel has no Landlock; the task can read what the agent can\n")
    env = dict(os.environ)
    if lc_ctype == "drop":  # in a C locale this interpreter set LC_CTYPE for itself (PEP 538)
        env.pop("LC_CTYPE", None)
    try:
        os.execvpe(task[0], task, env)
    except OSError as exc:
        sys.stderr.write(f"sandbox: cannot run {task[0]!r}: {exc}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
