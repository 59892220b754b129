"""A tiny llama served for the engine and verification tests, and requests to send it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gpuflex.serve.model import ServedModel
from gpuflex.testing import save_llama, write_corpus


@pytest.fixture(scope="session")
def corpus_lines(tmp_path_factory) -> list[str]:
    texts = tmp_path_factory.mktemp("serve-texts") / "t"
    write_corpus(texts, files=1, lines=200)
    return (texts / "part0.txt").read_text().splitlines()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, corpus_lines) -> Path:
    # init_std 0.1: peaked distributions, and layers whose weights matter to the hidden states, as in a
    # trained model (transformers' 0.02 leaves the residual stream nearly the embeddings, so an int8
    # copy of the layers barely moves it)
    return save_llama(
        tmp_path_factory.mktemp("serve-model") / "m",
        ["\n".join(corpus_lines)],
        hidden=64,
        context=256,
        init_std=0.1,
    )


@pytest.fixture(scope="session")
def served(model_dir) -> ServedModel:
    return ServedModel.load(model_dir, device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def served_bf16(tmp_path_factory, corpus_lines) -> ServedModel:
    """A wider model (256: int8 weights move 16-bit hidden states farther than at 64, the rest as above)
    as a replica serves it by default: its fp32 checkpoint in bf16."""
    wide = save_llama(
        tmp_path_factory.mktemp("serve-wide") / "m",
        ["\n".join(corpus_lines)],
        hidden=256,
        heads=4,
        context=256,
        init_std=0.1,
    )
    return ServedModel.load(wide, device="cpu")


@pytest.fixture(scope="session")
def conversations(corpus_lines) -> list[list[dict]]:
    """Chats of a system message and a user message, of different lengths."""
    rng = random.Random(0)
    return [
        [
            {"role": "system", "content": " ".join(rng.sample(corpus_lines, 1 + i % 3))},
            {"role": "user", "content": rng.choice(corpus_lines)},
        ]
        for i in range(6)
    ]
