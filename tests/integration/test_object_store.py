"""A network whose coordinator keeps its blobs on S3 (moto's server on loopback): a job trains to the
end and a model is deployed and answers, while every blob byte — the corpus and the model uploaded, the
states and pseudo-gradients of the rounds, the checkpoint fetched, the replica's download — moves
between the store and the CLI, agents and tasks by presigned URLs. The coordinator carries none: its
proxied byte counters stay 0, and what it signed uploads for is exactly what the bucket holds."""

from __future__ import annotations

import json
import re

import openai
import pytest
from tests.storage import conftest as storage

from gpuflex.cli.watch import TERMINAL
from gpuflex.localnet import LocalNetwork
from gpuflex.testing import blob_bytes, save_llama, small_job, wait_for, write_corpus

from .test_deployments import _cli
from .test_finetune import client_token
from .test_network import FAST_LIVENESS, _start, _submit

pytestmark = pytest.mark.integration

s3_endpoint, s3_bucket = storage.s3_endpoint, storage.s3_bucket  # the storage suite's fixtures


def test_a_job_and_a_deployment_run_with_their_bytes_moving_straight_to_and_from_the_store(
    tmp_path, s3_bucket, s3_endpoint
):
    import s3fs

    write_corpus(tmp_path / "data")
    spec = small_job(tmp_path / "data", workers=1, rounds=2)
    model_dir = save_llama(tmp_path / "my-model", ["alpha beta gamma delta. " * 50], hidden=64, init_std=0.1)
    settings = {
        **FAST_LIVENESS,
        "GPUFLEX_BLOB_URL": s3_bucket,
        "GPUFLEX_BLOB_STORAGE_OPTIONS": json.dumps(storage.s3_options(s3_endpoint)),
    }
    with LocalNetwork(tmp_path / "net", settings=settings) as net:
        client = _start(net, community=1)
        url = net.url
        job_id = _submit(client, spec, tmp_path)
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 240, "the job to end")
        assert job.state == "completed", [e.message for e in client.logs(job_id)][-10:]
        assert len(client.checkpoint(job_id)) > 0  # fetched from the store, checked against its hash

        who = ["--url", url, "--token", client_token(client)]
        out = _cli("deploy", "--model", str(model_dir), "--max-price", "0.5", "--budget", "1", "--wait", *who)
        deployment = re.search(r"deployed (d-[0-9a-f]+)", out)[1]
        key = re.search(r"gfxkey_[\w-]+", _cli("deployment", "key", "create", deployment, *who))[0]
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        said = gateway.chat.completions.create(
            model=deployment, messages=[{"role": "user", "content": "alpha"}], max_tokens=4
        )
        assert said.usage.completion_tokens >= 1
        client.stop_deployment(deployment)

        counted = blob_bytes(url)
    bucket = s3fs.S3FileSystem(**storage.s3_options(s3_endpoint), skip_instance_cache=True)
    stored = {path: info["size"] for path, info in bucket.find(s3_bucket, detail=True).items()}
    assert not [p for p in stored if "/uploads/" in p]  # every upload was committed or refused, and deleted
    assert counted["in"] == 0 and counted["out"] == 0  # the coordinator carried no blob bytes
    assert counted["signed_in"] == sum(stored.values())
    # what was read: the corpus and the model's files by tasks, states and deltas between them, the
    # checkpoint by its owner; at least the model, which the replica downloads whole
    model_bytes = sum(f.stat().st_size for f in model_dir.iterdir())
    assert counted["signed_out"] >= model_bytes > 0
