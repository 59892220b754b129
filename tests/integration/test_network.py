"""The real thing on loopback: a coordinator process and agent processes train a job to the end."""

from __future__ import annotations

import random
import signal
import time

import pytest

from gpuflex.client import Client
from gpuflex.ledger import accounts
from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import balances, verify_chain
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.spec import JobSpec

pytestmark = pytest.mark.integration

FAST_LIVENESS = {"GPUFLEX_HEARTBEAT_INTERVAL_S": "1", "GPUFLEX_LEASE_TTL_S": "8"}
TERMINAL = ("completed", "failed", "cancelled")


def _corpus(directory) -> None:
    """A small text with structure a model can learn quickly."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "train", "node", "round", "model", "lease", "epoch"]
    directory.mkdir()
    for i in range(4):
        lines = [" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(400)]
        (directory / f"part{i}.txt").write_text("\n".join(lines))


def _spec(data_dir, *, workers: int, rounds: int, inner_steps: int = 15) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "it",
            "resources": {"workers": workers},
            "training": {
                "rounds": rounds,
                "inner_steps": inner_steps,
                "batch_size": 16,
                "lr": 0.01,
                "round_timeout_s": 60,
                "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
            },
            "data": {"source": str(data_dir), "extensions": [".txt"], "max_bytes": 100_000},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
        }
    )


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _start(net: LocalNetwork, community: int) -> Client:
    url = net.start_coordinator()
    net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
    for i in range(community):
        net.start_agent(f"c{i}", price=round(0.10 + i / 100, 2))
    client = Client(url, Client(url).create_account("it").token)
    client.deposit(5)
    _wait(
        lambda: sum(o.state == "online" for o in client.offers()) == community + 1, 90, "agents to register"
    )
    return client


def _submit(client: Client, spec: JobSpec, tmp_path) -> str:
    from gpuflex.cli.jobs import upload_inputs

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
    earned = sum(v for k, v in totals.items() if k.startswith("provider:")) + totals.get(
        accounts.PLATFORM_FEES, 0
    )
    assert earned == round(job.spent * 1e6)


def test_a_two_worker_job_trains_to_the_end(database_url, tmp_path):
    import torch

    from gpuflex.train.outer import load_model
    from gpuflex.train.recipes import build_model

    _corpus(tmp_path / "data")
    spec = _spec(tmp_path / "data", workers=2, rounds=3)
    with LocalNetwork(tmp_path / "net", database_url=database_url, settings=FAST_LIVENESS) as net:
        client = _start(net, community=2)
        job_id = _submit(client, spec, tmp_path)
        job = _wait(lambda: (j := client.job(job_id)).state in TERMINAL and j, 240, "the job to end")
        assert job.state == "completed", [e.message for e in client.logs(job_id)][-10:]
        assert job.round == 3
        assert job.val_loss < job.initial_val_loss
        assert {t.role for t in job.tasks if t.node_id} == {"aggregator", "worker"}
        model = build_model(spec.training)
        assert load_model(model, client.checkpoint(job_id))["round"] == 3
        tokens = torch.randint(0, 256, (1, 16))
        assert model(tokens)[0].shape[-1] == 256
        _check_money(client, job_id)
        assert {c.name for c in job.costs} == {"core", "c0", "c1"}


def test_an_agent_stopped_mid_job_hands_its_task_back_and_the_job_completes(tmp_path):
    _corpus(tmp_path / "data")
    spec = _spec(tmp_path / "data", workers=2, rounds=12, inner_steps=60)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=3)
        job_id = _submit(client, spec, tmp_path)
        _wait(lambda: client.job(job_id).round >= 1, 180, "round 1")
        busy = {t.node_id for t in client.job(job_id).tasks if t.role == "worker" and t.state == "leased"}
        names = {o.node_id: o.name for o in client.offers()}
        leaving = names[sorted(busy)[0]]
        net.stop_agent(leaving, signal.SIGTERM)
        job = _wait(lambda: (j := client.job(job_id)).state in TERMINAL and j, 240, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        assert any("stopped before the job ended" in e or "released" in e for e in events), events
        handed_back = next(t for t in job.tasks if t.role == "worker" and t.epoch == 2)
        spare = handed_back.node_id
        assert names.get(spare) not in (None, leaving)
        assert any(e.startswith(f"[{spare}] round") for e in events), "the spare never contributed"
        assert {o.name: o.state for o in client.offers()}[leaving] == "left"
        _check_money(client, job_id)
