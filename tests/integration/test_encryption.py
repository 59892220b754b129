"""``privacy.encrypt`` on a real local network: the consumer's CLI encrypts the corpus and the model
directory it fine-tunes before upload, the job waits (saying why) while no one serves its key, trains
once ``gpuflex job keys`` seals the key to its leased nodes, and ``gpuflex job fetch --format hf`` brings
home a model that loads; the coordinator's database, data directory and blob store, and the nodes'
caches, never hold the corpus's or the model directory's canary, and a node gets no key for a lease that
ended."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gpuflex.auth.signing import NodeKey
from gpuflex.client import Client, NodeClient
from gpuflex.errors import Conflict
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.testing import save_llama, small_job, wait_for, write_corpus

from .test_network import FAST_LIVENESS

pytestmark = pytest.mark.integration


def _env(home: Path, net: LocalNetwork, token: str) -> dict[str, str]:
    return {"HOME": str(home), "GPUFLEX_URL": net.url, "GPUFLEX_TOKEN": token, "COLUMNS": "200"}


def _run(home: Path, net: LocalNetwork, token: str, *args: str) -> str:
    """The CLI in this process (no interpreter to start), as the consumer on its machine (``home``)."""
    from gpuflex.cli.main import app

    result = CliRunner().invoke(app, list(args), env=_env(home, net, token))
    assert result.exit_code == 0, result.output
    return result.output


def test_an_encrypted_job_trains_and_comes_home_while_the_coordinator_holds_only_ciphertext(tmp_path):
    canary = f"CANARY-{secrets.token_hex(8)}"
    write_corpus(tmp_path / "data")
    (tmp_path / "data" / "part0.txt").write_text((canary + " alpha beta.\n") * 50, encoding="utf-8")
    model_dir = save_llama(tmp_path / "model", ["alpha beta gamma. " * 40], hidden=16, vocab_size=260)
    for name in ("config.json", "tokenizer_config.json"):  # the model's canary: in config and tokenizer
        path = model_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "note": canary}))
    tuned = {"recipe": "hf-causal-lm", "model": {"from": str(model_dir), "block_size": 32}, "lora": {"r": 4}}
    spec = small_job(tmp_path / "data", workers=1, rounds=2, name="secret", **tuned)
    job_file = tmp_path / "job.yaml"
    body = spec.model_dump(mode="json", exclude_defaults=True, by_alias=True)
    job_file.write_text(yaml.safe_dump({**body, "privacy": {"encrypt": True}}))
    home = tmp_path / "home"
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        url = net.start_coordinator()
        net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
        net.start_agent("c0", price=0.1)
        token = Client(url).create_account("lab").token
        client = Client(url, token)
        client.deposit(5)
        wait_for(lambda: sum(o.state == "online" for o in client.offers()) == 2, 90, "agents to register")

        out = _run(home, net, token, "submit", str(job_file))
        job_id = client.jobs()[0].id
        assert f"gpuflex job keys {job_id}" in " ".join(out.split()), out  # the terminal may fold it
        waiting = "waits for the consumer's data key (lease"  # nobody serves the key yet: said, not silent
        wait_for(lambda: any(waiting in e.message for e in client.logs(job_id)), 60, "the key wait")
        assert client.job(job_id).rounds_log == []  # the aggregator cannot even publish round 0 without it
        shown = _run(home, net, token, "job", "show", job_id)
        assert f"wait(s) for the data key: run `gpuflex job keys {job_id}`" in " ".join(shown.split()), shown

        served = _run(home, net, token, "job", "keys", job_id)  # it returns once the job has ended
        assert "data key sealed to aggregator 0 on core" in served and "worker 0 on c0" in served, served
        job = client.job(job_id)
        assert job.state == "completed", [e.message for e in client.logs(job_id)][-10:]
        assert job.round == 2 and job.val_loss < job.initial_val_loss

        fetched = _run(
            home, net, token, "job", "fetch", job_id, "--format", "hf", "-o", str(tmp_path / "tuned")
        )
        assert "final LoRA adapter" in fetched, fetched  # opened here, over the base checked by the job's key
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").config.note == canary
        assert canary.encode() not in client.checkpoint(job_id)

        # a node holding no live lease gets no key: every lease of the job has ended
        core = NodeClient(url, NodeKey.load_or_create(net.root / "agents" / "core" / "node.key"))
        aggregator = next(t for t in job.tasks if t.role == "aggregator")
        lease_id = _lease_of(net, aggregator.id)
        with pytest.raises(Conflict, match="no longer live: no key"):
            core.lease_key(lease_id, aggregator.epoch)
        core.close()

        net.stop()  # the database's WAL checkpointed and closed: every byte is on disk
        stored = [p for p in (net.root / "coordinator").rglob("*") if p.is_file()]  # database, blobs
        assert any(p.suffix == ".db" for p in stored) and any(p.parent.name != "coordinator" for p in stored)
        stored.append(net.root / "logs" / "coordinator.log")
        cached = [p for p in (net.root / "agents").glob("*/cache/**/*") if p.is_file()]
        assert len(cached) > 3  # the nodes cached the model's manifest and parts: as ciphertext
        stored += cached
        for path in stored:
            assert canary.encode() not in path.read_bytes(), path
        assert canary.encode() in (tmp_path / "data" / "part0.txt").read_bytes()


def _lease_of(net: LocalNetwork, task_id: str) -> str:
    import sqlite3

    with sqlite3.connect(net.root / "coordinator" / "gpuflex.db") as db:
        (lease_id,) = db.execute("SELECT id FROM leases WHERE task_id = ?", (task_id,)).fetchone()
    return lease_id
