"""A federated job on a real local network: three owners with prepared datasets of different sizes and
different text (non-IID), one of which does not admit the consumer. The job completes on exactly the two
admitted owners, each worker reading only its own node's data, and no owner's canary reaches the
coordinator's database, data directory (its blob store in it) or log, nor the core node or another owner."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuflex.cli.inputs import upload_inputs
from gpuflex.client import Client
from gpuflex.data.manifest import read_manifest
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.spec import parse_job_spec
from gpuflex.testing import prepare_bytes, wait_for

from .test_network import FAST_LIVENESS, TERMINAL

pytestmark = pytest.mark.integration

# per owner: its canary, its words (disjoint: non-IID) and its size in lines
OWNERS = {
    "hospital": ("CANARY-hospital-5e1f", ["ward", "dose", "scan", "nurse", "chart"], 300),
    "bank": ("CANARY-bank-9a27", ["loan", "rate", "fund", "ledger", "asset"], 900),
    "outsider": ("CANARY-outsider-c3d4", ["gene", "cell", "assay", "probe", "plate"], 500),
}


def _prepare(root: Path, name: str) -> Path:
    canary, words, lines = OWNERS[name]
    rng = random.Random(name)
    text = root / f"{name}-text"
    text.mkdir()
    body = [" ".join(rng.choice(words) for _ in range(8)) + f" {canary}." for _ in range(lines)]
    (text / "records.txt").write_text("\n".join(body))
    return prepare_bytes(text, root / f"{name}-prepared", shard_tokens=8_000, val_tokens=2_000)


def _needles(canary: str) -> list[bytes]:
    """The canary as text, and as the byte tokenizer's shards hold it (uint16 little-endian ids)."""
    raw = canary.encode()
    return [raw, np.frombuffer(raw, np.uint8).astype("<u2").tobytes()]


def _holding(root: Path, canary: str) -> list[Path]:
    """Every file under ``root`` whose bytes contain ``canary`` in either form."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return [p for p in files if any(n in p.read_bytes() for n in _needles(canary))]


def _spec(rounds: int, round_timeout_s: float, privacy: dict | None = None, **resources):
    return parse_job_spec(
        {
            "name": "federated",
            "resources": resources,
            "training": {
                "rounds": rounds,
                "inner_steps": 4,
                "batch_size": 8,
                "lr": 0.01,
                "round_timeout_s": round_timeout_s,
                "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
            },
            "data": {"federated": "records"},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
            "privacy": privacy or {},
        }
    )


def _start(net: LocalNetwork, prepared: dict[str, Path]) -> tuple[Client, str]:
    """The coordinator, a core node and an agent per owner (all but the outsider admit lab); lab's client
    and its token."""
    url = net.start_coordinator()
    net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
    for name, directory in prepared.items():
        admits = "bank-of-labs" if name == "outsider" else "lab"
        net.start_agent(
            name, price=0.1, extra=["--private-data", f"records={directory}", "--allow-consumer", admits]
        )
    token = Client(url).create_account("lab").token
    lab = Client(url, token)
    lab.deposit(5)
    online = len(prepared) + 1
    wait_for(lambda: sum(o.state == "online" for o in lab.offers()) == online, 90, "agents to register")
    return lab, token


def test_a_federated_job_trains_on_the_admitted_owners_and_their_data_stays_home(tmp_path):
    prepared = {name: _prepare(tmp_path, name) for name in OWNERS}
    spec = _spec(rounds=2, round_timeout_s=60)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        lab, token = _start(net, prepared)
        job_id = lab.submit(spec, **upload_inputs(lab, spec)).id  # as `gpuflex submit`: nothing to upload
        job = wait_for(lambda: (j := lab.job(job_id)).state in TERMINAL and j, 180, "the job to end")
        assert job.state == "completed", [e.message for e in lab.logs(job_id)][-10:]
        names = {o.node_id: o.name for o in lab.offers()}
        tokens = {name: read_manifest(prepared[name]).train_tokens for name in OWNERS}
        assert sorted((names[o.node_id], o.tokens) for o in job.owners) == sorted(
            (name, tokens[name]) for name in ("hospital", "bank")
        )
        workers = {names[t.node_id] for t in job.tasks if t.role == "worker"}
        assert workers == {"hospital", "bank"}
        assert job.rounds_log[-1].contributions == 2 and job.train_loss is not None
        log = [e.message for e in lab.logs(job_id)]
        assert any("outsider" in x and "does not admit consumer lab" in x for x in log), log
        shown = subprocess.run(
            [sys.executable, "-m", "gpuflex", "job", "show", job_id, "--url", net.url, "--token", token],
            capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"}, check=True,
        ).stdout  # fmt: skip
        owners = shown[shown.index("owners (data.federated)") :]
        for name in ("hospital", "bank"):
            assert re.search(rf"{name}\s.*records\s.*{tokens[name]:,}", owners), shown
        assert "outsider" not in owners

        net.stop()  # the coordinator's database and files at rest, every process gone
        for name, (canary, _, _) in OWNERS.items():
            assert _holding(prepared[name], canary), name  # the search finds the data where it is
            assert _holding(net.root / "coordinator", canary) == [], name
            assert _holding(net.root / "logs", canary) == [], name
            for other in {"core", *OWNERS} - {name}:
                assert _holding(net.root / "agents" / other, canary) == [], (name, other)
        for name in ("hospital", "bank"):  # each worker read its shards where they lie: none was fetched
            cached = [p for p in (net.root / "agents" / name / "cache").rglob("*") if p.is_file()]
            assert cached == [], (name, cached)


def test_a_lost_owners_worker_waits_for_it_while_the_rounds_go_on_with_the_others(tmp_path):
    prepared = {name: _prepare(tmp_path, name) for name in ("hospital", "bank")}
    spec = _spec(rounds=12, round_timeout_s=10, min_workers=1)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        lab, _ = _start(net, prepared)
        job_id = lab.submit(spec).id
        wait_for(lambda: lab.job(job_id).round >= 1, 120, "the first round")
        net.kill_agent("bank")  # the machine dies, its worker with it
        wait_for(
            lambda: any("waits for its owner bank (not online)" in e.message for e in lab.logs(job_id)),
            60,
            "bank's worker to wait for bank",
        )
        job = wait_for(lambda: (j := lab.job(job_id)).state in TERMINAL and j, 180, "the job to end")
        assert job.state == "completed", [e.message for e in lab.logs(job_id)][-10:]
        assert job.rounds_log[-1].contributions == 1  # the hospital's alone
        names = {o.node_id: o.name for o in lab.offers()}
        lost = next(o for o in job.owners if names[o.node_id] == "bank")
        task = next(t for t in job.tasks if t.id == lost.task_id)
        assert (task.node_id, task.epoch) == (None, 1), task  # leased once, by bank; never moved
