"""A new user's fine-tune on a real network: a saved model directory with LoRA in bf16, submitted as
`gpuflex submit` does (the directory uploaded in parts under the blob limit), trained by agents on
loopback, and fetched as a Hugging Face directory that transformers loads and generates with."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from gpuflex.cli.jobs import upload_inputs, upload_model
from gpuflex.cli.main import app
from gpuflex.localnet import LocalNetwork
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import save_llama, small_job, wait_for, write_corpus

from .test_network import FAST_LIVENESS, TERMINAL, _check_money, _start

pytestmark = pytest.mark.integration

BLOB_LIMIT = 96 * 1024  # the model's weights (about 210 kB) go up in parts; a LoRA round's blobs fit


def test_a_lora_fine_tune_of_a_model_directory_trains_and_fetches_as_a_hugging_face_directory(tmp_path):
    import transformers

    write_corpus(tmp_path / "data")
    model_dir = save_llama(tmp_path / "my-model", [(tmp_path / "data" / "part0.txt").read_text()])
    spec = small_job(tmp_path / "data", workers=2, rounds=2, inner_steps=8)
    training = {
        **spec.training.model_dump(mode="json", exclude={"model"}),
        "recipe": "hf-causal-lm",
        "model": {"from": str(model_dir), "block_size": 32},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "precision": "bf16",
    }
    spec = JobSpec.model_validate({**spec.model_dump(mode="json"), "training": training})
    settings = {**FAST_LIVENESS, "GPUFLEX_MAX_BLOB_BYTES": str(BLOB_LIMIT)}
    with LocalNetwork(tmp_path / "net", settings=settings) as net:
        client = _start(net, community=2)
        spec = upload_model(client, spec)
        job_id = client.submit(spec, **upload_inputs(client, spec)).id
        job = wait_for(lambda: (j := client.job(job_id)).state in TERMINAL and j, 300, "the job to end")
        events = [e.message for e in client.logs(job_id)]
        assert job.state == "completed", events[-10:]
        sent = [float(kb) for kb in re.findall(r"sent (\d+\.\d) kB", "\n".join(events))]
        weights = (model_dir / "model.safetensors").stat().st_size
        assert len(sent) == 4 and all(kb * 1e3 < weights / 20 for kb in sent), sent  # 2 workers x 2 rounds
        _check_money(client, job_id)
        out = tmp_path / "tuned"
        for merge, directory in ((False, out), (True, tmp_path / "merged")):
            args = ["job", "fetch", job_id, "--format", "hf", "-o", str(directory), "--url", net.url]
            fetched = CliRunner().invoke(
                app, [*args, "--token", client_token(client), *(["--merge"] * merge)]
            )
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
