"""The real thing on loopback: a coordinator process and agent processes train a job to the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from gpuflex.cli.watch import TERMINAL
from gpuflex.client import Client
from gpuflex.ledger import accounts
from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import balances, verify_chain
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import check_invariants, small_job, wait_for, write_corpus

pytestmark = pytest.mark.integration

FAST_LIVENESS = {"GPUFLEX_HEARTBEAT_INTERVAL_S": "1", "GPUFLEX_LEASE_TTL_S": "8"}


def _start(net: LocalNetwork, community: int) -> Client:
    url = net.start_coordinator()
    net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
    for i in range(community):
        net.start_agent(f"c{i}", price=round(0.10 + i / 100, 2))
    client = Client(url, Client(url).create_account("it").token)
    client.deposit(5)
    wait_for(
        lambda: sum(o.state == "online" for o in client.offers()) == community + 1, 90, "agents to register"
    )
    return client


def _submit(client: Client, spec: JobSpec, tmp_path) -> str:
    from gpuflex.cli.inputs import upload_inputs

    return client.submit(spec, **upload_inputs(client, spec)).id


def _check_money(client: Client, job_id: str, deposit: float = 5.0) -> None:
    journal = from_export(client.ledger())
    report = verify_chain(journal)
    assert report.ok, report.problem
    totals = balances(journal)
    assert sum(totals.values()) == 0
    assert totals.get(accounts.escrow(job_id), 0) == 0
    job = client.job(job_id)
    assert client.balance().balance == pytest.approx(deposit - job.spent)
    earned = sum(v for k, v in totals.items() if k.startswith(accounts.HELD)) + totals.get(
        accounts.PLATFORM_FEES, 0
    )
    assert earned == round(job.spent * 1e6)


# PostgreSQL only: the demo's, the browser's and the chaos suite's jobs run to the end on SQLite.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_two_worker_job_trains_to_the_end(database_url, tmp_path):
    import torch

    from gpuflex.train.outer import load_model
    from gpuflex.train.recipes import build_model

    write_corpus(tmp_path / "data")
    spec = small_job(tmp_path / "data", workers=2, rounds=3)
    with LocalNetwork(tmp_path / "net", database_url=database_url, settings=FAST_LIVENESS) as net:
        client = _start(net, community=2)
        job_id = _submit(client, spec, tmp_path)
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 240, "the job to end")
        assert job.state == "completed", [e.message for e in client.logs(job_id)][-10:]
        assert job.round == 3
        assert job.val_loss < job.initial_val_loss
        assert [v.reason for v in job.verdicts if v.guilty] == []  # every provider is honest
        assert {t.role for t in job.tasks if t.node_id} == {"aggregator", "worker"}
        model = build_model(spec.training)
        assert load_model(model, client.checkpoint(job_id))["round"] == 3
        tokens = torch.randint(0, 256, (1, 16))
        assert model(tokens)[0].shape[-1] == 256
        _check_money(client, job_id)
        assert {c.name for c in job.costs} == {"core", "c0", "c1"}
        events = [e.message for e in client.logs(job_id)]
        published = [e for e in events if re.search(r"round \d+ published|published round", e)]
        assert [e.split(" (")[0] for e in published] == [
            f"round {r} published" for r in range(4)
        ]  # once each
        workers = {t.index: t.node_id for t in job.tasks if t.role == "worker"}
        for index, node_id in workers.items():  # each worker's own lines say which worker on which node
            assert any(
                e.startswith(f"[worker {index} on c") and f"({node_id})] round 1: " in e for e in events
            )


def test_an_agent_stopped_mid_job_hands_its_task_back_and_the_job_completes(tmp_path):
    write_corpus(tmp_path / "data")
    spec = small_job(tmp_path / "data", workers=2, rounds=12, inner_steps=60)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=3)
        job_id = _submit(client, spec, tmp_path)
        wait_for(lambda: client.job(job_id).round >= 1, 180, "round 1")
        busy = {t.node_id for t in client.job(job_id).tasks if t.role == "worker" and t.state == "leased"}
        names = {o.node_id: o.name for o in client.offers()}
        leaving = names[sorted(busy)[0]]
        net.stop_agent(leaving, signal.SIGTERM)
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 240, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        assert any("stopped before the job ended" in e or "released" in e for e in events), events
        handed_back = next(t for t in job.tasks if t.role == "worker" and t.epoch == 2)
        spare = handed_back.node_id
        assert names.get(spare) not in (None, leaving)
        spare_says = f"[worker {handed_back.index} on {names[spare]} ({spare})] "
        assert any(e.startswith(f"{spare_says}joined at round ") for e in events), events
        assert any(e.startswith(f"{spare_says}round") for e in events), "the spare never contributed"
        assert {o.name: o.state for o in client.offers()}[leaving] == "left"
        _check_money(client, job_id)


def test_a_cheating_provider_is_convicted_slashed_barred_and_the_job_completes(tmp_path):
    from gpuflex.auth.signing import NodeKey
    from gpuflex.client import NodeClient

    write_corpus(tmp_path / "data")
    spec = small_job(tmp_path / "data", workers=3, rounds=4)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=3)  # c0, c1, c2: one is a spare
        net.start_agent("cheater", price=0.05, extra=["--adversary", "scaled"])
        wait_for(
            lambda: sum(o.state == "online" for o in client.offers()) == 5, 90, "the cheater to register"
        )
        cheater = NodeClient(
            net.url, NodeKey.load_or_create(tmp_path / "net" / "agents" / "cheater" / "node.key")
        )
        cheater.stake(2.0)
        job_id = _submit(client, spec, tmp_path)
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 300, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        cheater_id = cheater.key.node_id
        guilty = [v for v in job.verdicts if v.guilty]
        assert guilty and {v.node_id for v in guilty} == {cheater_id}, job.verdicts
        assert guilty[-1].slashed == 1.0  # the first conviction took the spec's slash
        assert any("was found cheating" in e for e in events), events
        assert all(t.node_id != cheater_id for t in job.tasks), job.tasks  # barred: never re-leased
        # Where its task went next is not asserted: convicted in the job's last round (a round with
        # fewer than three contributions screens no norms), the job may end before the market re-leases
        # it. tests/coordinator/test_verification.py holds the re-leasing to an honest node.
        assert cheater.wallet().slashed == pytest.approx(sum(v.slashed for v in guilty))
        _check_money(client, job_id)


def test_a_peer_that_frames_an_honest_provider_is_convicted_by_the_core_node_and_the_job_completes(tmp_path):
    """Peer audits on the real network: the two workers re-run each other's drawn segments; the framer
    (cheapest, so placed) reports a hash it did not compute, the core node re-runs that one segment,
    clears the honest provider and convicts the framer, whose task goes to the spare (which may join
    only as the job ends: its rounds are short)."""
    from gpuflex.auth.signing import NodeKey
    from gpuflex.client import NodeClient

    write_corpus(tmp_path / "data")
    verification = {"audit_rate": 1.0, "trace_every": 3, "peer_segments": 5}  # 15 steps: 5 segments
    spec = small_job(tmp_path / "data", workers=2, rounds=3, verification=verification)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=2)  # c0 works beside the framer, c1 is the spare
        net.start_agent("framer", price=0.05, extra=["--adversary", "framer"])
        wait_for(lambda: sum(o.state == "online" for o in client.offers()) == 4, 90, "the framer to register")
        framer = NodeClient(
            net.url, NodeKey.load_or_create(tmp_path / "net" / "agents" / "framer" / "node.key")
        )
        framer.stake(2.0)
        job_id = _submit(client, spec, tmp_path)
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 300, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        guilty = [v for v in job.verdicts if v.guilty]
        assert [(v.node_id, v.check) for v in guilty] == [(framer.key.node_id, "dispute")], job.verdicts
        (cleared,) = [v for v in job.verdicts if v.check == "dispute" and not v.guilty]
        assert cleared.evidence["peer"] == guilty[0].task_id and cleared.round == guilty[0].round
        assert any("as its peer" in e for e in events), events
        assert all(t.node_id != framer.key.node_id for t in job.tasks), job.tasks  # barred
        assert framer.wallet().slashed == pytest.approx(1.0)
        _check_money(client, job_id)


def test_a_job_starts_only_with_min_workers_placed_and_every_worker_left_out_says_why(tmp_path):
    """3 workers asked, 2 community nodes: with min_workers 3 (the default) the job waits and says why;
    with min_workers 2 it runs on 2, and the third says why it waits and ends `unplaced`."""
    write_corpus(tmp_path / "data")
    spec = small_job(tmp_path / "data", workers=3, rounds=3).model_dump(mode="json")
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=2)
        token = client.http._http.headers["Authorization"].removeprefix("Bearer ")

        def gpuflex(*args: str) -> str:
            command = [sys.executable, "-m", "gpuflex", *args, "--url", net.url, "--token", token]
            done = subprocess.run(
                command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "1000"}
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        def submit(min_workers: int | None) -> tuple[str, str]:
            (path := tmp_path / f"job-{min_workers}.yaml").write_text(
                yaml.safe_dump({**spec, "resources": {**spec["resources"], "min_workers": min_workers}})
            )
            out = gpuflex("submit", str(path))
            return re.search(r"submitted job (j-\w+)", out)[1], " ".join(out.split())

        waiting, out = submit(None)
        # the 2 nodes in rank order: their real benchmarks decide it
        why = re.search(
            r"2 of the 3 workers this job needs to start \(resources\.min_workers\) can be placed now "
            r"\(on (c0, c1|c1, c0)\)",
            out,
        )
        assert (
            why
            and f"the job waits: it cannot start now {why[0]}: core: kept for this job's aggregator" in out
        )
        told = f"aggregator 0 and workers 0, 1, 2 wait: {why[0]}"
        wait_for(lambda: told in gpuflex("job", "logs", waiting), 30, "the job's log to say why it waits")
        assert (
            gpuflex("job", "show", waiting).count(f"waits: {why[0]}") == 4
        )  # every task, the aggregator too
        assert client.job(waiting).state == "pending" and not any(t.epoch for t in client.job(waiting).tasks)
        client.cancel(waiting)

        running, out = submit(2)
        assert "the job starts on fewer workers than it asks for" in out, out
        assert "1 of the 3 workers would wait, and join when a node frees: no free node qualifies" in out
        job = wait_for(lambda: (j := client.job(running)).state in TERMINAL and j, 240, "the job to end")
        events = [e.message for e in client.logs(running)]
        assert job.state == "completed", events[-10:]
        left_out = next(t for t in job.tasks if t.role == "worker" and t.index == 2)
        assert (left_out.state, left_out.epoch) == ("unplaced", 0)  # never `completed`: it never ran
        assert left_out.placement.startswith("never placed: no free node qualifies: c"), left_out.placement
        # busy nodes say what they do, never whose job it is (another consumer's work is not shown)
        assert "busy (worker, leased)" in left_out.placement and running not in left_out.placement
        assert sum(e.startswith("worker 2 waits: no free node qualifies") for e in events) == 1, events
        shown = gpuflex("job", "show", running)
        assert (
            re.search(r"worker 2 +│ unplaced +│ - ", shown)
            and "never placed: no free node qualifies" in shown
        )
        assert max(r.contributions for r in job.rounds_log) == 2  # the job ran on the 2 it could place
        assert check_invariants(net.database) == []
        _check_money(client, running)
