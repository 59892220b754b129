"""A new user's fine-tune on a real network: JSONL data prepared with the model's tokenizer, a saved model
directory with LoRA in bf16, submitted with `gpuflex submit` (the directory uploaded in parts under the
blob limit, the shards each fetched by the workers that train on them, the model's files kept in each
node's cache), trained by agents on loopback, and fetched as a Hugging Face directory that transformers
loads and generates with."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from gpuflex.cli.main import app
from gpuflex.localnet import LocalNetwork
from gpuflex.storage.bundles import bundle_directory
from gpuflex.testing import save_llama, small_job, wait_for, write_corpus
from gpuflex.train.checkpoint import sha256

from .test_network import FAST_LIVENESS, TERMINAL, _check_money, _start

pytestmark = pytest.mark.integration

BLOB_LIMIT = 96 * 1024  # the model's weights (about 210 kB) go up in parts; a LoRA round's blobs fit


def test_a_lora_fine_tune_of_a_model_directory_trains_and_fetches_as_a_hugging_face_directory(tmp_path):
    """The issue's loop as a new user runs it: JSONL data prepared with the model's own tokenizer, a
    model directory with LoRA in bf16, `gpuflex submit`, and `gpuflex job fetch --format hf`."""
    import json

    import transformers
    import yaml

    write_corpus(tmp_path / "text")
    documents = [p.read_text() for p in sorted((tmp_path / "text").iterdir())]
    lines = [line for doc in documents for line in doc.splitlines() if line.strip()]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(lines[i : i + 8])}) + "\n" for i in range(0, len(lines), 8))
    )
    model_dir = save_llama(tmp_path / "my-model", documents)
    prepared = tmp_path / "prepared"
    source = ["data", "prepare", str(corpus), "--field", "text", "--tokenizer", str(model_dir)]
    made = CliRunner().invoke(
        app, [*source, "-o", str(prepared), "--shard-tokens", "4096", "--val-tokens", "1024"]
    )
    assert made.exit_code == 0, made.output
    spec = small_job(tmp_path / "text", workers=2, rounds=2, inner_steps=8).model_dump(mode="json")
    spec["training"] |= {
        "recipe": "hf-causal-lm",
        "model": {"from": str(model_dir), "block_size": 32},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "precision": "bf16",
    }
    spec["data"] = {"prepared": str(prepared)}
    spec_file = tmp_path / "finetune.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    settings = {**FAST_LIVENESS, "GPUFLEX_MAX_BLOB_BYTES": str(BLOB_LIMIT)}
    with LocalNetwork(tmp_path / "net", settings=settings) as net:
        client = _start(net, community=2)
        who = ["--url", net.url, "--token", client_token(client)]
        submitted = CliRunner().invoke(app, ["submit", str(spec_file), *who])
        assert submitted.exit_code == 0, submitted.output
        job_id = re.search(r"submitted job (j-[0-9a-f]+)", submitted.output)[1]
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 300, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        sent = [float(kb) for kb in re.findall(r"sent (\d+\.\d) kB", "\n".join(events))]
        weights = (model_dir / "model.safetensors").stat().st_size
        assert len(sent) == 4 and all(kb * 1e3 < weights / 20 for kb in sent), sent  # 2 workers x 2 rounds
        _check_money(client, job_id)
        bundle, _ = bundle_directory(model_dir, BLOB_LIMIT)
        model_blobs = {sha256(bundle.to_bytes()), *(f.sha256 for f in bundle.files)}
        names = {o.node_id: o.name for o in client.offers()}
        for node in {t.node_id for t in job.tasks}:  # the base model stays on each node for its next jobs
            cached = {p.name for p in (net.root / "agents" / names[node] / "cache" / "blobs").iterdir()}
            assert model_blobs <= cached, names[node]
        out = tmp_path / "tuned"
        for merge, directory in ((False, out), (True, tmp_path / "merged")):
            args = ["job", "fetch", job_id, "--format", "hf", "-o", str(directory), *who]
            fetched = CliRunner().invoke(app, [*args, *(["--merge"] * merge)])
            assert fetched.exit_code == 0, fetched.output
    for directory in (out, tmp_path / "merged"):
        tuned = transformers.AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        ids = tokenizer("alpha beta", return_tensors="pt").input_ids
        assert tuned.generate(ids, max_new_tokens=3, do_sample=False).shape[-1] == ids.shape[-1] + 3
    assert (out / "adapter_config.json").is_file()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()


def client_token(client) -> str:
    return client.http._http.headers["Authorization"].removeprefix("Bearer ")
