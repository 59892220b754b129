"""A new user's fine-tune on a real network: JSONL data prepared with the model's tokenizer, a saved model
directory with LoRA in bf16, submitted with `gpuflex submit` (the directory uploaded in parts under the
blob limit, the shards each fetched by the workers that train on them, the model's files kept in each
node's cache), trained by agents on loopback, and fetched as a Hugging Face directory that transformers
loads and generates with; then the README's "Bring your own model and data" from its fetch on, as written:
the LoRA adapter fetched, served (`gpuflex serve`) and deployed (`gpuflex deploy --model`), each merging
it into the base it names, and answering."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from gpuflex.cli.main import app
from gpuflex.localnet import LocalNetwork
from gpuflex.storage.bundles import bundle_directory
from gpuflex.testing import save_llama, small_job, wait_for, write_corpus
from gpuflex.train.checkpoint import sha256

from .test_network import FAST_LIVENESS, TERMINAL, _check_money, _start

pytestmark = pytest.mark.integration

BLOB_LIMIT = 96 * 1024  # the model's weights (about 210 kB) go up in parts; a LoRA round's blobs fit
README = (Path(__file__).parents[2] / "README.md").read_text()


def readme_steps() -> list[list[str]]:
    """The commands of the README's "Bring your own model and data" from `gpuflex job fetch` on, each
    without its leading `gpuflex`."""
    section = README[README.index("## Bring your own model and data") :]
    start = section.index("```sh\n") + len("```sh\n")
    block = section[start : section.index("```", start)]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    fetch = next(i for i, words in enumerate(commands) if words[1:3] == ["job", "fetch"])
    return [words[1:] for words in commands[fetch:]]


def test_a_lora_fine_tune_of_a_model_directory_trains_and_fetches_as_a_hugging_face_directory(
    tmp_path, monkeypatch
):
    """The issue's loop as a new user runs it: JSONL data prepared with the model's own tokenizer, a
    model directory with LoRA in bf16, `gpuflex submit`, `gpuflex job fetch --format hf`, and the README's
    fetch, serve and deploy of the adapter."""
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
        merged = ["job", "fetch", job_id, "--format", "hf", "--merge", "-o", str(tmp_path / "merged"), *who]
        fetched = CliRunner().invoke(app, merged)
        assert fetched.exit_code == 0, fetched.output
        _readme_fetch_serve_deploy(tmp_path, monkeypatch, job_id, client, net.url)
    out = tmp_path / "my-model-tuned"
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(model_dir.resolve())  # the directory the job was submitted from, as serve looks for it
    for directory in (out, tmp_path / "merged"):
        tuned = transformers.AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        ids = tokenizer("alpha beta", return_tensors="pt").input_ids
        assert tuned.generate(ids, max_new_tokens=3, do_sample=False).shape[-1] == ids.shape[-1] + 3
    assert not (tmp_path / "merged" / "adapter_config.json").exists()


def _readme_fetch_serve_deploy(tmp_path, monkeypatch, job_id: str, client, url: str) -> None:
    """The README's fetch, serve and deploy as written, run in ``tmp_path`` (where ./my-model is): the
    adapter served answers a completion (uvicorn's run replaced by one request) and deployed answers one
    through the gateway."""
    import uvicorn

    fetch, serve, deploy = readme_steps()
    who = ["--url", url, "--token", client_token(client)]
    monkeypatch.chdir(tmp_path)
    fetched = CliRunner().invoke(app, [*(job_id if w == "JOB" else w for w in fetch), *who])
    assert fetched.exit_code == 0 and "LoRA adapter" in fetched.output, fetched.output
    answers = []

    def answer_once(server_app, **_) -> None:
        with TestClient(server_app) as http:
            body = {"model": "my-model-tuned", "prompt": "alpha", "max_tokens": 3, "temperature": 0}
            answers.append(http.post("/v1/completions", json=body).json())

    monkeypatch.setattr(uvicorn, "run", answer_once)
    served = CliRunner().invoke(app, serve)
    assert served.exit_code == 0, served.output
    assert answers[0]["usage"]["completion_tokens"] == 3, answers
    client.deposit(5)  # the deploy's default budget: the job spent some of the first 5
    deployed = CliRunner().invoke(app, [*deploy, *who])
    assert deployed.exit_code == 0, deployed.output
    deployment = re.search(r"deployed (d-[0-9a-f]+)", deployed.output)[1]
    assert "(uploaded)" in deployed.output and "my-model-tuned" in deployed.output
    gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=client_token(client), max_retries=0, timeout=30)

    def answered():
        try:
            return gateway.completions.create(model=deployment, prompt="alpha", max_tokens=3)
        except (openai.InternalServerError, openai.APITimeoutError):  # 503 while the replica loads
            return None

    assert wait_for(answered, 120, "the deployment to answer").usage.completion_tokens >= 1
    client.stop_deployment(deployment)


def client_token(client) -> str:
    return client.http._http.headers["Authorization"].removeprefix("Bearer ")
