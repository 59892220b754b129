"""The task sandbox, with real child processes: environment, work dir, limits, killing, logs."""

import json
import os
import resource
import stat
import sys
import time
from pathlib import Path

import pytest

from gpuflex.agent import confine
from gpuflex.agent.sandbox import ENV_ALLOWLIST, Limits, TaskProcess, scrubbed_env, start_task
from gpuflex.auth.signing import NodeKey
from gpuflex.client import Client
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import wait_for

SMALL = Limits(memory_mb=512)


def run(tmp_path: Path, code: str, limits: Limits = SMALL, **env_extra: str) -> tuple[int, str]:
    task = start(tmp_path, code, limits, **env_extra)
    try:
        code = task.wait(timeout=60)
    finally:
        task.kill()
    return code, task.tail()


def start(tmp_path: Path, code: str, limits: Limits = SMALL, **env_extra: str) -> TaskProcess:
    return start_task(
        [sys.executable, "-c", code],
        workdir=tmp_path / "work",
        env_extra=env_extra,
        limits=limits,
        log_path=tmp_path / "logs" / "task.log",
    )


def wait_for_log(task: TaskProcess, needle: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while needle not in (text := task.tail()):
        assert time.monotonic() < deadline, f"{needle!r} never appeared in the log: {text!r}"
        time.sleep(0.05)
    return text


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_child_sees_only_allowlisted_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEX_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "AKIA-not-for-tasks")
    monkeypatch.setenv("HOME", "/home/agent")
    monkeypatch.setenv("PYTHONPATH", "/agent/src")
    monkeypatch.setenv("TZ", "Europe/Berlin")

    code, log = run(tmp_path, "import json, os; print(json.dumps(dict(os.environ)))", GPUFLEX_TASK_TOKEN="t")

    assert code == 0, log
    env = json.loads(log)
    assert "hunter2" not in log and "AKIA-not-for-tasks" not in log
    assert set(env) <= {*ENV_ALLOWLIST, "HOME", "TMPDIR", "GPUFLEX_TASK_TOKEN"}
    assert env["HOME"] == str(tmp_path / "work")
    assert env["GPUFLEX_TASK_TOKEN"] == "t"
    assert env["TZ"] == "Europe/Berlin"
    assert env["PATH"] == os.environ["PATH"]


def test_wrapper_adds_no_lc_ctype_in_c_locale(tmp_path, monkeypatch):
    # a Python task would add LC_CTYPE itself (PEP 538), so the task here is env(1)
    for name in ("LANG", "LC_ALL", "LC_CTYPE"):
        monkeypatch.delenv(name, raising=False)

    task = start_task(["env"], workdir=tmp_path, env_extra={}, limits=SMALL, log_path=tmp_path / "env.log")

    assert task.wait(timeout=30) == 0
    assert sorted(line.split("=")[0] for line in task.tail().splitlines()) == ["HOME", "PATH", "TMPDIR"]


def test_scrubbed_env_keeps_allowlist_and_adds_extra():
    parent = {"PATH": "/bin", "LANG": "C.UTF-8", "HOME": "/root", "GPUFLEX_KEY": "x", "SSH_AUTH_SOCK": "/s"}

    assert scrubbed_env({"HOME": "/w"}, parent) == {"PATH": "/bin", "LANG": "C.UTF-8", "HOME": "/w"}
    assert scrubbed_env({}, {})["PATH"] == os.defpath


def test_child_runs_in_private_workdir(tmp_path):
    (tmp_path / "work").mkdir(mode=0o755)

    code, log = run(tmp_path, "import os; print(os.getcwd())")

    assert code == 0, log
    assert os.path.realpath(log.strip()) == os.path.realpath(tmp_path / "work")
    assert stat.S_IMODE((tmp_path / "work").stat().st_mode) == 0o700


def test_memory_hog_fails_under_limit_while_small_program_succeeds(tmp_path):
    hog_code, hog_log = run(tmp_path, "b = bytearray(2 * 1024**3); print('allocated')")
    small_code, small_log = run(tmp_path, "b = bytearray(16 * 1024**2); print('fine', len(b))")

    assert hog_code != 0
    assert "MemoryError" in hog_log and "allocated" not in hog_log
    assert small_code == 0, small_log
    assert small_log.endswith(f"fine {16 * 1024**2}\n")  # the log is appended to, not truncated


def test_torch_matmul_fits_the_default_memory_limit(tmp_path):
    code, log = run(
        tmp_path, "import torch; print((torch.ones(1000, 1000) @ torch.ones(1000, 1000))[0, 0])", Limits()
    )

    assert code == 0, log
    assert "1000." in log


def test_rlimits_are_applied(tmp_path):
    limits = Limits(memory_mb=1024, cpu_seconds=30, max_file_mb=8, max_open_files=64)
    code, log = run(
        tmp_path,
        "import resource as r; print([r.getrlimit(x) for x in "
        "(r.RLIMIT_NOFILE, r.RLIMIT_CORE, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_CPU)])",
        limits,
    )

    assert code == 0, log
    mb = 2**20
    assert log.strip() == str([(64, 64), (0, 0), (1024 * mb, 1024 * mb), (8 * mb, 8 * mb), (30, 35)])


def test_unlimited_memory_and_cpu_leave_parent_limits(tmp_path):
    code, log = run(
        tmp_path,
        "import resource as r; print([r.getrlimit(x) for x in (r.RLIMIT_AS, r.RLIMIT_CPU)])",
        Limits(memory_mb=None),
    )

    assert code == 0, log
    assert log.strip() == str(
        [resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_CPU)]
    )


@pytest.mark.parametrize("field", ["memory_mb", "cpu_seconds", "max_file_mb", "max_open_files"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: 0})


def test_terminate_kills_child_and_grandchild(tmp_path):
    task = start(
        tmp_path,
        "import subprocess, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "print('grandchild', p.pid, flush=True)\n"
        "time.sleep(60)\n",
    )
    grandchild = int(wait_for_log(task, "grandchild").split()[1])
    assert not is_gone(grandchild)

    task.terminate(grace_s=5)

    assert task.poll() == -15
    deadline = time.monotonic() + 5
    while not is_gone(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived terminate()"
        time.sleep(0.05)


def test_terminate_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    task = start(
        tmp_path,
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n",
    )
    wait_for_log(task, "ready")

    task.terminate(grace_s=0.3)

    assert task.poll() == -9


def test_missing_program_exits_127_with_a_message(tmp_path):
    task = start_task(
        ["no-such-program-gpuflex"],
        workdir=tmp_path / "work",
        env_extra={},
        limits=SMALL,
        log_path=tmp_path / "task.log",
    )

    assert task.wait(timeout=30) == 127
    assert "cannot run 'no-such-program-gpuflex'" in task.tail()


def test_tail_returns_the_end_of_the_log(tmp_path):
    task = start(tmp_path, "print('x' * 10000 + 'END')")

    assert task.wait(timeout=30) == 0
    assert task.tail(10) == "xxxxxxEND\n"
    assert len(task.tail()) == 4000
    assert TaskProcess(task._popen, tmp_path / "missing.log").tail() == ""


MALICIOUS = Path(__file__).with_name("malicious_recipe.py")
AGENT_SECRET = "hunter2-agent-secret"


def plant_secrets(data_dir: Path) -> None:
    """What an agent's data dir holds besides the running task: its key and an earlier task's files."""
    (data_dir / "tasks" / "earlier").mkdir(parents=True)
    NodeKey.load_or_create(data_dir / "node.key")
    (data_dir / "tasks" / "earlier" / "result.bin").write_text("another task's result")


def assert_got_nothing(log: str, work_dir: Path) -> None:
    """The probe's report shows it read its own files and nothing of anyone else's."""
    line = next((x for x in log.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, f"the probe did not report: {log}"
    report = json.loads(line.removeprefix("PROBE "))
    assert report["work_dir"] == str(work_dir)
    assert report["own_file"] != "" and not report["own_file"].startswith("refused")
    for what in (
        "node_key",
        "node_key_via_proc",
        "task_dirs",
        "other_task_file",
        "database",
        "agent_environ",
    ):
        assert str(report[what]).startswith("refused"), f"the task could read {what}: {report[what]!r}"
    assert report["agent_environ"].startswith("refused")
    assert report["env_secret"] == "" and AGENT_SECRET not in log
    assert "PRIVATE KEY" not in log and "another task's result" not in log


def test_a_malicious_task_reads_nothing_outside_its_work_dir(tmp_path, monkeypatch):
    if confine.abi_version() < 1:
        pytest.skip("this kernel has no Landlock: the task would run unconfined (the sandbox says so)")
    monkeypatch.setenv("GPUFLEX_AGENT_SECRET", AGENT_SECRET)
    data_dir = tmp_path / "agents" / "a1"
    plant_secrets(data_dir)
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "gpuflex.db").write_text("SQLite format 3 accounts")
    work = data_dir / "tasks" / "lease-1"
    work.mkdir(parents=True)
    (work / "task.json").write_text('{"job_id": "j-1"}')

    task = start_task(
        [sys.executable, "-c", MALICIOUS.read_text()],
        workdir=work,
        env_extra={},
        limits=SMALL,
        log_path=work / "task.log",
    )

    assert task.wait(timeout=60) != 0  # the recipe ends itself once it has reported
    assert_got_nothing(task.tail(20_000), work)


@pytest.mark.integration
def test_a_malicious_recipe_run_by_a_real_agent_reads_nothing_of_the_agent_or_coordinator(tmp_path):
    if confine.abi_version() < 1:
        pytest.skip("this kernel has no Landlock: the task would run unconfined (the sandbox says so)")
    plant_secrets(tmp_path / "agents" / "core")
    with LocalNetwork(tmp_path, settings={"GPUFLEX_AGENT_SECRET": AGENT_SECRET}) as net:
        url = net.start_coordinator()
        net.start_agent("core", price=0.1, core=True, extra=["--core-token", CORE_TOKEN])
        net.start_agent("box", price=0.1)  # a job starts with its aggregator and its worker placed together
        client = Client(url, Client(url).create_account("mallory").token)
        client.deposit(5)
        wait_for(lambda: len(client.offers()) == 2, 90, "the agents to register")
        spec = JobSpec.model_validate(
            {
                "name": "probe",
                "resources": {"workers": 1},
                "training": {"recipe": "user", "recipe_file": str(MALICIOUS), "rounds": 1},
                "data": {"source": "none"},
                "budget": 1,
            }
        )
        client.submit(spec, recipe_code=client.upload(MALICIOUS.read_bytes()))
        tasks = tmp_path / "agents" / "core" / "tasks"

        def reported() -> Path | None:
            return next((p for p in tasks.glob("*/task.log") if "PROBE " in p.read_text()), None)

        log = wait_for(reported, 120, "the malicious task to report")
        assert_got_nothing(log.read_text(), log.parent)


def test_a_private_dataset_is_readable_but_not_writable_and_its_neighbours_stay_out_of_reach(tmp_path):
    """A federated worker's ``read_only`` directory: its owner's data, to read and nothing more."""
    if confine.abi_version() < 1:
        pytest.skip("this kernel has no Landlock: the task would run unconfined (the sandbox says so)")
    private = tmp_path / "owner" / "notes"
    private.mkdir(parents=True)
    (private / "train-00000.bin").write_text("the owner's records")
    (tmp_path / "owner" / "other").mkdir()
    (tmp_path / "owner" / "other" / "x.bin").write_text("another dataset")
    probe = f"""
import pathlib
def attempt(fn):
    try:
        return repr(fn())
    except OSError as err:
        return "refused " + type(err).__name__
d = pathlib.Path({str(private)!r})
print("READ", attempt(lambda: (d / "train-00000.bin").read_text()))
print("WRITE", attempt(lambda: (d / "planted.bin").write_text("x")))
print("OTHER", attempt(lambda: (d.parent / "other" / "x.bin").read_text()))
"""
    task = start_task(
        [sys.executable, "-c", probe],
        workdir=tmp_path / "work",
        env_extra={},
        limits=SMALL,
        log_path=tmp_path / "logs" / "task.log",
        read_only=[private],
    )
    assert task.wait(timeout=60) == 0, task.tail()
    log = task.tail()
    assert 'READ "the owner\'s records"' in log, log
    assert "WRITE refused" in log and "OTHER refused" in log, log
    assert not (private / "planted.bin").exists()
