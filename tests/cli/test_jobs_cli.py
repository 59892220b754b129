"""``gpuflex jobs`` and the ``job`` group as a user runs them: real commands (subprocesses) against a real
coordinator served on loopback in this process (SQLite; the tests move its clock), its jobs driven through
the real round protocol. Ids print whole and any unique prefix is taken; what the costs show is what the
ledger settled; budgets keep their precision; tables fit 80 columns; ``--json``; how ``job watch`` and
``submit --watch`` exit, and what Ctrl-C says; who wrote each log line; ``job fetch`` before the end.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuflex.client import Client, NodeClient, TaskClient
from gpuflex.coordinator.app import create_app, reap_once
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import make_engine, make_sessionmaker
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.ledger import accounts
from gpuflex.ledger.export import from_export
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage import LocalBlobStore
from gpuflex.testing import Clock, register_node, serve, small_job, write_corpus

CORE_TOKEN = "core-secret"
PRICE = 36.0  # credits per hour: 0.01 a second, so a budget of 0.001 runs out within a second


@dataclass
class Net:
    url: str
    ctx: CoordinatorContext
    clock: Clock
    alice: Client
    token: str
    nodes: list[NodeClient]
    home: Path

    def gpuflex(self, *args: str, token: str | None = None, columns: int = 80) -> subprocess.CompletedProcess:
        """The real command, as alice (or ``token``), in a terminal ``columns`` wide."""
        env = {**os.environ, "HOME": str(self.home), "COLUMNS": str(columns)}
        command = [sys.executable, "-m", "gpuflex", *args, "--url", self.url, "--token", token or self.token]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)

    def start(self, job_id: str) -> dict[str, TaskClient]:
        """Place and lease the job's tasks (every node asks, each gets one task at most): role -> task."""
        tasks = {}
        for node in self.nodes:
            grant = node.lease()
            if grant is not None:
                assert grant.job_id == job_id, "an earlier test left a job open"
                tasks[grant.role] = TaskClient(self.url, grant.task_token, retry_for_s=0)
        return tasks


def _node(url: str, name: str, *, core: bool = False) -> NodeClient:
    return register_node(url, name, core_token=CORE_TOKEN if core else None, price=PRICE)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("coordinator")
    database_url = f"sqlite:///{data_dir / 'gpuflex.db'}"
    upgrade(database_url)
    settings = CoordinatorSettings(
        data_dir=data_dir,
        database_url=database_url,
        core_token=CORE_TOKEN,
        lease_ttl_s=3600,  # the tests move the clock: no lease expires, no node is lost meanwhile
        heartbeat_interval_s=600,
        reaper_interval_s=3600,  # the tests reap when they mean to
        lease_placement_interval_s=0,
        platform_fee_bps=1000,
    )
    engine = make_engine(database_url)
    clock = Clock()
    ctx = CoordinatorContext(
        settings, engine, make_sessionmaker(engine), LocalBlobStore(data_dir / "blobs"), clock
    )
    try:
        with serve(create_app(ctx=ctx)) as url:
            token = Client(url).create_account("alice").token
            alice = Client(url, token)
            alice.deposit(100)
            nodes = [_node(url, "core", core=True), _node(url, "box-0"), _node(url, "box-1")]
            yield Net(url, ctx, clock, alice, token, nodes, tmp_path_factory.mktemp("home"))
    finally:
        engine.dispose()


def _spec(budget: float = 5.0, rounds: int = 1, max_price: float = 40.0) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "resources": {"workers": 1},
            "budget": budget,
            "max_price_per_hour": max_price,
            "training": {"rounds": rounds},
        }
    )


def _submit(net: Net, client: Client | None = None, **spec) -> str:
    client = client or net.alice
    return client.submit(_spec(**spec), client.upload(b"corpus " * 200)).id


def _publish(aggregator: TaskClient, round_: int, contributions: int = 0) -> None:
    state = aggregator.put_blob(f"model after round {round_}".encode())
    update = None if round_ == 0 else aggregator.put_blob(f"update {round_}".encode())
    aggregator.publish_round(
        m.RoundPublish(
            round=round_,
            state_hash=f"{round_:x}" * 64,
            checkpoint=state,
            update=update,
            contributions=contributions,
            val_loss=5.0 - round_,
            train_loss=5.5 - round_,
        )
    )


def _contribute(worker: TaskClient, round_: int) -> None:
    delta = worker.put_blob(f"delta {round_}".encode() * 10)
    worker.submit_contribution(
        m.ContributionSubmit(round=round_, delta=delta, tokens=64, steps=2, train_loss=4.0)
    )


@pytest.fixture(scope="module")
def trained(net):
    """A job of one round run to the end: round 0 and 1 published, the worker's contribution cleared by
    a verdict. ``fetched``: what ``job fetch`` said while the job still ran (after round 0)."""
    job_id = _submit(net)
    tasks = net.start(job_id)
    _publish(tasks["aggregator"], 0)
    tasks["worker"].log("joined at round 0")
    _contribute(tasks["worker"], 0)
    worker_task = next(t.id for t in net.alice.job(job_id).tasks if t.role == "worker")
    tasks["aggregator"].report_verdict(
        m.VerdictSubmit(round=0, task_id=worker_task, guilty=False, check="screen", reason="norms in range")
    )
    fetched = net.gpuflex("job", "fetch", job_id, "-o", str(net.home / "early.safetensors"))
    _publish(tasks["aggregator"], 1, contributions=1)
    assert net.alice.job(job_id).state == "completed"
    return job_id, fetched


def test_job_fetch_says_which_round_and_that_a_running_job_is_not_final(net, trained):
    job_id, early = trained
    assert early.returncode == 0, early.stderr
    said = " ".join(early.stdout.split())
    assert "checkpoint of round 0 written to" in said, said
    assert f"not a final model: job {job_id} is still running (round 0/1)" in said
    assert (net.home / "early.safetensors").read_bytes() == b"model after round 0"
    final = net.gpuflex("job", "fetch", job_id[:6], "-o", str(net.home / "final.safetensors"))
    assert final.returncode == 0, final.stderr
    assert f"final model of job {job_id} (round 1) written to" in " ".join(final.stdout.split())
    assert (net.home / "final.safetensors").read_bytes() == b"model after round 1"


def test_job_logs_say_which_worker_on_which_node_wrote_a_line(net, trained):
    job_id, _ = trained
    worker = next(t for t in net.alice.job(job_id).tasks if t.role == "worker")
    events = [e.message for e in net.alice.logs(job_id)]
    box = next(o.name for o in net.alice.offers() if o.node_id == worker.node_id)
    line = f"[worker 0 on {box} ({worker.node_id})] joined at round 0"
    assert line in events, events
    printed = net.gpuflex("job", "logs", job_id, columns=200)
    assert line in printed.stdout, printed.stdout
    assert [e for e in events if "published" in e] == [
        "round 0 published (0 contributions, val loss 5.0000, train loss 5.5000)",
        "round 1 published (1 contributions, val loss 4.0000, train loss 4.5000)",
    ]


def test_job_show_fits_80_columns_with_ids_whole_and_every_reason_on_its_own_lines(net, trained):
    job_id, _ = trained
    job = net.alice.job(job_id)
    result = net.gpuflex("job", "show", job_id)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    for task in job.tasks:  # ids whole, each on one line; a reason begins a line and is not squeezed
        assert any(task.id in line and task.node_id in line for line in lines), result.stdout
        assert any(line.startswith(f"{task.role} {task.index}: {task.placement[:40]}") for line in lines)
    verdict = job.verdicts[0]
    assert any(verdict.task_id in line and verdict.node_id in line for line in lines), result.stdout
    assert f"round 0, task {verdict.task_id} (screen): norms in range" in lines
    assert f"spent {job.spent:.6f}".rstrip("0") in result.stdout and "of 5.00 credits" in result.stdout
    assert len(lines) < 45, result.stdout  # a dozen lines a task, as before, would not fit


def test_jobs_and_job_show_print_json(net, trained):
    job_id, _ = trained
    listed = net.gpuflex("jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    assert job_id in {j["id"] for j in json.loads(listed.stdout)}
    shown = net.gpuflex("job", "show", job_id, "--json")
    detail = m.JobDetail.model_validate_json(shown.stdout)
    assert detail.id == job_id and detail.state == "completed" and len(detail.rounds_log) == 2
    assert detail.tasks[0].placement  # the whole reason, for scripts


@pytest.fixture(scope="module")
def ran_out(net, trained):
    """A job whose budget of 0.001 ran out before round 1: it ended out of budget, and settled the whole
    budget."""
    job_id = _submit(net, budget=0.001)
    net.start(job_id)
    net.clock.advance(1)
    reap_once(net.ctx, judge_liveness=False)
    assert net.alice.job(job_id).state == "out_of_budget"
    return job_id


def test_a_watched_job_exits_by_how_it_ended(net, trained, ran_out):
    completed, _ = trained
    watched = net.gpuflex("job", "watch", completed)  # into a pipe: plain lines, each whole
    assert watched.returncode == 0 and "…" not in watched.stdout, watched.stdout
    lines = watched.stdout.splitlines()
    assert lines[0].startswith("round 1/1: completed loss ") and lines[0].endswith(" cr"), watched.stdout
    assert lines[1].startswith(f"job {completed} tiny: completed; round 1/1;"), watched.stdout
    watched = net.gpuflex("job", "watch", ran_out)
    assert watched.returncode == 5 and "out_of_budget (budget spent)" in watched.stdout, watched.stdout
    cancelled = _submit(net)
    said = net.gpuflex("job", "cancel", cancelled)
    assert said.returncode == 0 and "spent 0.00 of a 5.00 budget, 5.00 refunded" in said.stdout, said.stdout
    watched = net.gpuflex("job", "watch", cancelled)
    assert watched.returncode == 4 and f"job {cancelled} tiny: cancelled" in watched.stdout, watched.stdout


def test_costs_of_a_job_whose_budget_ran_out_are_what_the_ledger_settled(net, ran_out, tmp_path):
    (settlement,) = [e for e in from_export(net.alice.ledger()) if e.memo == f"job {ran_out} out_of_budget"]
    settled = -dict(settlement.postings)[accounts.escrow(ran_out)]
    assert settled == 1000  # micro-credits: the whole budget, nothing refunded
    detail = net.alice.job(ran_out)
    assert round(sum(c.cost for c in detail.costs) * 1e6) == settled == round(detail.spent * 1e6)
    assert sum(c.metered for c in detail.costs) > detail.spent  # what the meter read: more
    shown = net.gpuflex("job", "show", ran_out)
    assert "spent 0.001 of 0.001 credits" in shown.stdout, shown.stdout
    said = " ".join(shown.stdout.split())
    assert "the budget ran out: the leases metered" in said
    printed = [float(line.split("│")[5]) for line in shown.stdout.splitlines() if line.count("│") == 7]
    assert round(sum(printed) * 1e6) == settled, shown.stdout
    report = net.gpuflex("job", "report", ran_out, "-o", str(tmp_path / "r.png"))
    assert report.returncode == 0 and "spent 0.001 of a 0.001 budget" in report.stdout, report.stdout
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert round(sum(float(r["credits"]) for r in rows) * 1e6) == settled
    assert sum(float(r["metered"]) for r in rows) > 0.001


def test_ids_print_whole_and_any_unique_prefix_of_ones_own_is_taken(net, trained):
    job_id, _ = trained
    bob_token = Client(net.url).create_account("bob").token
    bob = Client(net.url, bob_token)
    bob.deposit(10)
    bobs = _submit(net, bob, max_price=0.01)  # nothing takes it: it waits
    listed = net.gpuflex("jobs")
    assert listed.returncode == 0, listed.stderr
    assert all(j.id in listed.stdout for j in net.alice.jobs()), listed.stdout
    others = [j.id for j in net.alice.jobs() if j.id != job_id] + [bobs]
    unique = next(
        job_id[:n] for n in range(3, len(job_id)) if not any(o.startswith(job_id[:n]) for o in others)
    )
    shown = net.gpuflex("job", "show", unique, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["id"] == job_id, shown.stderr
    ambiguous = net.gpuflex("job", "logs", "j-")
    assert ambiguous.returncode == 1 and len(ambiguous.stderr.strip().splitlines()) == 1, ambiguous.stderr
    assert "job id j- is ambiguous" in ambiguous.stderr and "(HTTP 409)" in ambiguous.stderr
    assert all(j.id in ambiguous.stderr for j in net.alice.jobs()[:10])
    as_bob = net.gpuflex("job", "show", "j-", "--json", token=bob_token)  # alice's jobs do not count
    assert as_bob.returncode == 0 and json.loads(as_bob.stdout)["id"] == bobs, as_bob.stderr
    theirs = net.gpuflex("job", "show", unique, token=bob_token)  # nor are they bob's to find
    assert theirs.returncode == 1 and f"no job {unique}" in theirs.stderr
    bob.cancel(bobs[:5])


def test_ctrl_c_on_submit_watch_says_the_job_goes_on_and_how_to_watch_or_cancel_it(net, tmp_path):
    write_corpus(tmp_path / "data", files=1, lines=250)
    spec = small_job(tmp_path / "data", workers=1, rounds=2).model_dump(mode="json")
    spec.update(budget=0.005, max_price_per_hour=0.01)  # no node asks so little: it waits, and is watched
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HOME": str(net.home)}
    command = [sys.executable, "-m", "gpuflex", "submit", str(tmp_path / "job.yaml"), "--watch"]
    process = subprocess.Popen(
        [*command, "--url", net.url, "--token", net.token],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_interruptible,
    )
    try:
        submitted = process.stdout.readline()
        assert "budget 0.005 credits in escrow" in submitted, submitted
        job_id = submitted.split()[2]
        time.sleep(1)  # into the watching, which the line above comes just before
        dispositions = _signal_dispositions(process.pid)  # what the child inherited, should it hang
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"no exit within 60 s of SIGINT; the child's signal masks then: {dispositions}; this process's "
            f"SIGINT handler {signal.getsignal(signal.SIGINT)}, "
            f"blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}"
        )
    finally:
        process.kill()  # whatever went wrong: it would watch the job forever
        process.wait()
    assert process.returncode == 130, (out, err)
    assert f"job {job_id} goes on" in err
    assert f"gpuflex job watch {job_id}" in err and f"gpuflex job cancel {job_id}" in err
    assert "Traceback" not in err
    assert net.alice.job(job_id).state == "pending"
    net.alice.cancel(job_id)


def _interruptible() -> None:
    """In the child, before it runs: SIGINT's default disposition, as a terminal gives a command. The test
    process itself may ignore SIGINT (a full run once had it ignored in a pytest worker, by something not
    found), and an ignored SIGINT is inherited: Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_dispositions(pid: int) -> dict[str, str]:
    """The ignored, blocked and caught signal masks of ``pid`` (``/proc``): SIGINT is bit 1 (0x2). A full
    run once saw the watch ignore SIGINT, which a child inherits when its parent ignores or blocks it."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        k: v.strip()
        for k, _, v in (line.partition(":") for line in lines)
        if k in ("SigIgn", "SigBlk", "SigCgt")
    }


def test_submit_warns_of_a_budget_short_of_the_quotes_low_end_and_refuses_one_short_of_a_first_round(
    net, tmp_path
):
    write_corpus(tmp_path / "data", files=1, lines=250)
    spec = small_job(tmp_path / "data", workers=1, rounds=4).model_copy(update={"max_price_per_hour": 40.0})
    low = net.alice.quote(spec).cost_low  # its budget of 1 covers it: not capped

    def submit(budget: float) -> subprocess.CompletedProcess:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump({**spec.model_dump(mode="json"), "budget": budget}))
        return net.gpuflex("submit", str(tmp_path / "job.yaml"), columns=200)

    refused = submit(low / 8)  # half its first round, at the quote's quickest
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "of this job's nodes, not its first round (≈ " in refused.stderr, refused.stderr
    assert "submitted" not in refused.stdout
    warned = submit(low / 2)
    assert warned.returncode == 0, warned.stderr
    said = " ".join(warned.stdout.split())
    assert "before the job can end" in said and "it would end out_of_budget" in said, said
    net.alice.cancel(said.split()[2])  # left waiting, the next test's nodes would take it
