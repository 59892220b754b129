"""``gpuflex train local``: a tiny job as processes prints its rounds; a bad option is one clear line."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:resource_tracker")


def _gpuflex(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", "train", "local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_tiny_job_prints_the_loss_of_every_round_and_each_workers_traffic(tmp_path):
    lines = [f"def f{i}(x, y):\n    return x * {i % 7} + y\n" for i in range(1000)]
    (tmp_path / "notes.txt").write_text("".join(lines))
    result = _gpuflex(
        *("--workers", "2", "--rounds", "2", "--inner-steps", "3", "--batch-size", "8"),
        *("--data", str(tmp_path), "--bandwidth-mbit", "100", "--latency-ms", "5"),
    )
    assert result.returncode == 0, result.stderr
    rounds = re.findall(r"^round +(\d+) +val (\d+\.\d+) +train (\S+) +(\d+) in", result.stdout, re.MULTILINE)
    assert [r[0] for r in rounds] == ["0", "1", "2"]
    assert [r[3] for r in rounds] == ["0", "2", "2"]  # both workers contributed to every round
    assert all(float(r[1]) > 0 for r in rounds)
    assert "worker-0" in result.stdout and "worker-1" in result.stdout
    assert "final validation loss" in result.stdout


def test_muon_inner_steps_train_a_tiny_job(tmp_path):
    (tmp_path / "notes.txt").write_text(
        "".join(f"def f{i}(x):\n    return x * {i % 7}\n" for i in range(900))
    )
    result = _gpuflex(
        *("--workers", "2", "--rounds", "1", "--inner-steps", "3", "--batch-size", "8"),
        *("--data", str(tmp_path), "--inner-optimizer", "muon"),
    )
    assert result.returncode == 0, result.stderr
    assert "1 rounds (int8, muon inner steps)" in result.stdout
    assert re.findall(r"^round +(\d+) .* (\d+) in", result.stdout, re.MULTILINE) == [("0", "0"), ("1", "2")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be between 1 and 256"),
        (["--inner-optimizer", "sgd"], "inner_optimizer: Input should be 'adamw' or 'muon'"),
        (["--compression", "zip"], "compression.method"),
        (["--data", "/nonexistent/dir"], "is not a directory"),
    ],
)
def test_a_bad_option_is_one_clear_line(args, message):
    result = _gpuflex(*args, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_a_prepared_dataset_trains_each_worker_on_its_own_shards(tmp_path):
    from gpuflex.testing import prepare_bytes, write_corpus

    write_corpus(tmp_path / "text")
    prepared = prepare_bytes(tmp_path / "text", tmp_path / "prepared", shard_tokens=18_000, val_tokens=4_000)
    result = _gpuflex(
        *("--workers", "2", "--rounds", "1", "--inner-steps", "3", "--batch-size", "8"),
        *("--prepared", str(prepared)),
    )
    assert result.returncode == 0, result.stderr
    assert re.findall(r"^round +(\d+) .* (\d+) in", result.stdout, re.MULTILINE) == [("0", "0"), ("1", "2")]
    assert "worker-0 read train-00000.bin, train-00001.bin, validation-00000.bin" in result.stdout
    assert "worker-1 read train-00002.bin, train-00003.bin, validation-00000.bin" in result.stdout


def test_a_prepared_dataset_too_small_for_the_job_is_one_clear_line(tmp_path):
    from gpuflex.testing import prepare_bytes, write_corpus

    write_corpus(tmp_path / "text", files=1, lines=20)
    prepared = prepare_bytes(tmp_path / "text", tmp_path / "prepared", shard_tokens=400, val_tokens=40)
    for args, message in [
        (
            ["--prepared", str(prepared)],
            "validation split (40 tokens in 1 shard(s)) is too small for block_size",
        ),
        (["--prepared", str(tmp_path / "text")], "has no manifest.json: not a prepared dataset"),
    ]:
        result = _gpuflex(*args, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and message in lines[0], result.stderr


def test_a_lora_bf16_fine_tune_of_a_model_directory_exports_a_directory_that_generates(tmp_path):
    import torch
    import transformers

    from gpuflex.testing import save_llama, write_corpus

    write_corpus(tmp_path / "data", files=2, lines=300)
    model = save_llama(tmp_path / "model", [(tmp_path / "data" / "part0.txt").read_text()])
    result = _gpuflex(
        *("--recipe", "hf-causal-lm", "--model-from", str(model), "--lora-r", "4", "--precision", "bf16"),
        *("--workers", "2", "--rounds", "2", "--inner-steps", "2", "--batch-size", "8", "--block-size", "32"),
        *("--micro-batch-size", "4", "--data", str(tmp_path / "data"), "--output-hf", str(tmp_path / "out")),
    )
    assert result.returncode == 0, result.stderr
    assert "LoRA r=4, bf16" in result.stdout
    rounds = re.findall(r"^round +(\d+) .* (\d+) in +up (\d+\.\d) kB", result.stdout, re.MULTILINE)
    assert [(r[0], r[1]) for r in rounds] == [("0", "0"), ("1", "2"), ("2", "2")]
    weights = (model / "model.safetensors").stat().st_size
    assert all(float(r[2]) * 1e3 < weights / 20 for r in rounds[1:])  # the adapters travel, not the model
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")(
        "alpha beta", return_tensors="pt"
    ).input_ids
    assert tuned.generate(ids, max_new_tokens=3, do_sample=False).shape[-1] == ids.shape[-1] + 3
    assert torch.isfinite(tuned(ids).logits).all()


def test_a_lora_target_that_names_no_module_is_one_line_naming_those_there_are(tmp_path):
    from gpuflex.testing import save_llama

    model = save_llama(tmp_path / "model", ["alpha beta gamma. " * 40])
    result = _gpuflex(
        *("--recipe", "hf-causal-lm", "--model-from", str(model), "--lora-r", "4", "--lora-targets", "qkv"),
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "qkv matches no module of the model; its modules: down_proj" in lines[0]
