from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    """A BPE tokenizer's tokenizer.json, alone in its directory (no config: its EOS is found by name)."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer().save(str(path))
    return path
