"""A job on a prepared dataset, on a real local network: each worker's node fetches only its own shards
and the validation split into its cache, the audits pass, and a second job on the same data uploads no
shard again."""

from __future__ import annotations

import re

import httpx
import pytest

from gpuflex.cli.data import upload_prepared
from gpuflex.data.assign import assign
from gpuflex.data.manifest import read_manifest
from gpuflex.localnet import LocalNetwork
from gpuflex.protocol.spec import parse_job_spec
from gpuflex.testing import prepare_bytes, wait_for, write_corpus

from .test_network import FAST_LIVENESS, TERMINAL, _start

pytestmark = pytest.mark.integration


def _bytes_in(url: str) -> float:
    """The blob bytes the coordinator has taken in (``gpuflex_blob_bytes_in``)."""
    return float(re.search(r"^gpuflex_blob_bytes_in_total (\S+)$", httpx.get(f"{url}/metrics").text, re.M)[1])


def test_workers_fetch_only_their_shards_audits_pass_and_the_data_goes_up_once(tmp_path):
    write_corpus(tmp_path / "text")
    prepared = prepare_bytes(tmp_path / "text", tmp_path / "prepared", shard_tokens=9_000, val_tokens=4_000)
    manifest = read_manifest(prepared)
    assert len(manifest.train) == 8
    spec = parse_job_spec(
        {
            "name": "prepared",
            "resources": {"workers": 2},
            "training": {
                "rounds": 2,
                "inner_steps": 8,
                "batch_size": 8,
                "lr": 0.01,
                "round_timeout_s": 60,
                "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
                "verification": {"audit_rate": 1.0},
            },
            "data": {"prepared": str(prepared)},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
        }
    )
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        client = _start(net, community=2)
        first = upload_prepared(client, spec, prepared)
        assert (first.shards, first.sent) == (9, 9)
        job_id = client.submit(spec, dataset=first.manifest).id
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 120, "the job to end")
        assert job.state == "completed", [e.message for e in client.logs(job_id)][-10:]
        assert job.val_loss < job.initial_val_loss
        audits = [v for v in job.verdicts if v.check == "audit"]
        assert audits and not any(v.guilty for v in job.verdicts), job.verdicts

        names = {o.node_id: o.name for o in client.offers()}
        for task in (t for t in job.tasks if t.role == "worker"):
            own = [
                manifest.train[s.shard].sha256
                for s in assign([s.tokens for s in manifest.train], task.index, 2)
            ]
            cached = {
                p.name for p in (net.root / "agents" / names[task.node_id] / "cache" / "blobs").iterdir()
            }
            assert cached == {*own, manifest.validation[0].sha256}, (task.index, names[task.node_id])
            assert len(own) == 4

        before = _bytes_in(net.url)
        second = upload_prepared(client, spec, prepared)  # a second job on the same data
        assert (second.sent, second.sent_bytes, _bytes_in(net.url)) == (0, 0, before)
        assert client.submit(spec, dataset=second.manifest).state == "pending"
