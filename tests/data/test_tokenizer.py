"""Tokenizers: each document's ids followed by EOS, the tokenizer's hash, and where its EOS comes from."""

from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.errors import BadRequest

from .helpers import EOS, documents, train_tokenizer


def test_bytes_are_utf8_with_a_newline_after_each_document():
    tokenizer = load_tokenizer(None)
    assert tokenizer.info.model_dump() == {"kind": "bytes", "hash": "bytes", "vocab_size": 256, "eos_id": 10}
    ids = tokenizer.encode(["ab", "ü"])
    assert ids.dtype == np.dtype("<u2") and ids.tolist() == list(b"ab\n\xc3\xbc\n")


def test_a_tokenizer_json_encodes_each_document_then_eos_and_is_named_by_its_hash(tokenizer_json):
    tokenizer = load_tokenizer(str(tokenizer_json))
    reference = Tokenizer.from_file(str(tokenizer_json))
    eos = reference.token_to_id(EOS)
    assert tokenizer.info.kind == "hf" and tokenizer.info.eos_id == eos
    assert tokenizer.info.hash == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    assert tokenizer.info.vocab_size == reference.get_vocab_size()
    docs = documents(20)
    expected = [i for d in docs for i in [*reference.encode(d, add_special_tokens=False).ids, eos]]
    assert tokenizer.encode(docs).tolist() == expected
    assert tokenizer.encode([]).tolist() == []


def test_a_model_directory_saved_by_transformers_gives_the_eos_its_config_names(tmp_path):
    from transformers import PreTrainedTokenizerFast

    base = train_tokenizer()
    base.add_special_tokens(["<end>"])
    PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<end>").save_pretrained(tmp_path)
    end = base.token_to_id("<end>")
    assert load_tokenizer(str(tmp_path)).info.eos_id == end  # the config's, not the well-known <|endoftext|>
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).info.eos_id == end  # the config beside the file


def test_a_saved_truncation_never_cuts_a_document(tmp_path):
    base = train_tokenizer()
    base.enable_truncation(max_length=4)
    base.save(str(tmp_path / "tokenizer.json"))
    assert len(load_tokenizer(str(tmp_path)).encode(["the " * 50])) > 5


def test_a_vocabulary_beyond_65536_ids_is_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.add_special_tokens(["</s>"])
    big.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.info.vocab_size == 70_002 and tokenizer.info.eos_id == 70_001
    ids = tokenizer.encode(["w69999 w1"])
    assert ids.dtype == np.dtype("<u4") and ids.tolist() == [69_999, 1, 70_001]


def test_a_tokenizer_on_an_fsspec_url(tokenizer_json):
    fs = fsspec.filesystem("memory")
    fs.pipe("/tok/tokenizer.json", tokenizer_json.read_bytes())
    try:
        assert load_tokenizer("memory://tok").info == load_tokenizer(str(tokenizer_json)).info
    finally:
        fs.rm("/tok", recursive=True)


def test_bad_tokenizer_paths_are_clear_errors(tmp_path):
    with pytest.raises(BadRequest, match=r"has no tokenizer.json \(a fast tokenizer's file"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(BadRequest, match="no such tokenizer file or directory"):
        load_tokenizer(str(tmp_path / "nothing"))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(BadRequest, match=r"is not a tokenizers tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_a_tokenizer_without_an_eos_says_how_to_name_one(tmp_path):
    plain = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(BadRequest, match=r"no EOS token for .*: put a tokenizer_config\.json with eos_token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(BadRequest, match="'</s>' is not in its vocabulary"):
        load_tokenizer(str(tmp_path))
