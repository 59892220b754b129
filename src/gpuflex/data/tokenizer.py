"""Text to token ids: a Hugging Face ``tokenizers`` tokenizer, or bytes (vocabulary 256, as today's jobs).

Each document's ids are followed by the end-of-document id: the tokenizer's EOS token, or for bytes a
newline, as ``train.corpus`` has always joined files. A Hugging Face tokenizer is loaded from its
``tokenizer.json`` (a model directory's, or the file itself, on any fsspec URL); its EOS token is the
one ``tokenizer_config.json`` or ``special_tokens_map.json`` beside it names, else a special token of a
well-known EOS name. Documents are encoded a batch at a time with ``encode_batch_fast``: Rust threads
over the batch's documents, the GIL released, and no character offsets computed (nobody reads them).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import tokenizers
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from gpuflex.data.manifest import BYTE_TOKENIZER, TokenizerInfo, dtype_for, numpy_dtype
from gpuflex.errors import BadRequest

TOKENIZER_JSON = "tokenizer.json"
_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")  # where transformers writes eos_token
_EOS_NAMES = (
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
)  # GPT-2/Qwen, Llama 2/Mistral, Llama 3, Gemma


class Tokenizer(ABC):
    """Encodes batches of documents into one flat array of ids in the manifest's dtype."""

    info: TokenizerInfo

    @property
    def dtype(self) -> np.dtype:
        return numpy_dtype(dtype_for(self.info.vocab_size))

    @abstractmethod
    def encode(self, documents: Sequence[str]) -> np.ndarray:
        """The ids of ``documents`` in order, each document's followed by ``info.eos_id``."""


class ByteTokenizer(Tokenizer):
    info = BYTE_TOKENIZER

    def encode(self, documents: Sequence[str]) -> np.ndarray:
        data = "".join(d + "\n" for d in documents).encode()
        return np.frombuffer(data, np.uint8).astype(self.dtype)


class HFTokenizer(Tokenizer):
    def __init__(self, tokenizer_json: bytes, eos_token: str | None, where: str):
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json.decode())
        except Exception as err:  # the Rust parser's errors have no common type
            raise BadRequest(f"{where} is not a tokenizers tokenizer.json: {err}") from None
        self._tokenizer.no_truncation()  # a saved max_length would cut documents without a word
        self._tokenizer.no_padding()
        eos = eos_token or _well_known_eos(self._tokenizer)
        eos_id = self._tokenizer.token_to_id(eos) if eos else None
        if eos_id is None:
            raise BadRequest(
                f"no EOS token for {where}: "
                + (
                    f"{eos!r} is not in its vocabulary"
                    if eos
                    else "put a tokenizer_config.json with eos_token beside its tokenizer.json"
                )
            )
        vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        digest = hashlib.sha256(tokenizer_json).hexdigest()
        self.info = TokenizerInfo(kind="hf", hash=digest, vocab_size=vocab_size, eos_id=eos_id)

    def encode(self, documents: Sequence[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch_fast(list(documents), add_special_tokens=False)
        eos = (self.info.eos_id,)
        count = sum(len(e) for e in encodings) + len(encodings)
        ids = itertools.chain.from_iterable(itertools.chain(e.ids, eos) for e in encodings)
        return np.fromiter(ids, self.dtype, count)


def load_tokenizer(path: str | None) -> Tokenizer:
    """Bytes for None; else the tokenizer of a model directory or of a ``tokenizer.json`` path or URL."""
    if path is None:
        return ByteTokenizer()
    fs, fs_path = url_to_fs(path)
    if fs.isdir(fs_path):
        directory, json_path = fs_path, posixpath.join(fs_path, TOKENIZER_JSON)
        if not fs.exists(json_path):
            raise BadRequest(
                f"{path} has no {TOKENIZER_JSON} (a fast tokenizer's file: transformers' "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one)"
            )
    elif fs.exists(fs_path):
        directory, json_path = posixpath.dirname(fs_path), fs_path
    else:
        raise BadRequest(f"no such tokenizer file or directory: {path!r}")
    return HFTokenizer(fs.cat_file(json_path), _configured_eos(fs, directory), path)


def _configured_eos(fs: AbstractFileSystem, directory: str) -> str | None:
    for name in _CONFIGS:
        config = posixpath.join(directory, name)
        if fs.exists(config):
            try:
                eos = json.loads(fs.cat_file(config)).get("eos_token")
            except (ValueError, AttributeError):
                raise BadRequest(f"{config} is not a JSON object") from None
            if isinstance(eos, dict):  # transformers' AddedToken form: {"content": "</s>", ...}
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def _well_known_eos(tokenizer: tokenizers.Tokenizer) -> str | None:
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((name for name in _EOS_NAMES if name in special), None)
