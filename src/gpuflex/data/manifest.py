"""A prepared dataset's manifest: what its shards are, how they were made, and how to check them.

``manifest.json`` sits beside the shards and is written last, atomically, so a directory with one is
complete. It is strict (unknown keys are errors that name the field, as in the job spec) and
deterministic: the same inputs, tokenizer and options give the same bytes, and its hash (``digest``:
sha256 of those bytes, its blob key) names the whole dataset. A shard is raw little-endian token ids
(``dtype``), named by its sha256 in the blob store, so a shard file is a blob as it is.

The token stream is every document's ids followed by the tokenizer's EOS id, in the sources' order.
The last tokens of the stream are the validation split (``validation``: the last documents, the first
of them possibly cut); the rest is ``train``. Each split is cut into shards of ``shard_tokens`` tokens,
its last shard shorter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuflex.errors import BadRequest, HashMismatch
from gpuflex.protocol.spec import describe_validation_error
from gpuflex.storage.blobs import write_atomic

MANIFEST = "manifest.json"
BYTE_VOCAB = 256  # the bytes tokenizer's vocabulary, and a model built from a job spec's shape's
Dtype = Literal["uint16", "uint32"]
Kind = Literal["text", "jsonl", "parquet", "arrow"]  # how a source file is read (gpuflex.data.sources)
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def dtype_for(vocab_size: int) -> Dtype:
    """The narrowest dtype that holds every id: half the bytes for any vocabulary up to 65,536."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def numpy_dtype(dtype: Dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TokenizerInfo(_Strict):
    """Which tokenizer made the ids: ``hash`` is sha256 of its ``tokenizer.json`` ("bytes" for bytes)."""

    kind: Literal["hf", "bytes"]
    hash: Annotated[str, Field(pattern=r"^([0-9a-f]{64}|bytes)$")]
    vocab_size: Annotated[int, Field(ge=1, le=1 << 32)] = Field(description="every id is below it")
    eos_id: Annotated[int, Field(ge=0)] = Field(
        description="the id after every document: the tokenizer's EOS token; for bytes a newline (10)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TokenizerInfo:
        if self.eos_id >= self.vocab_size:
            raise ValueError(f"eos_id {self.eos_id} is not below vocab_size {self.vocab_size}")
        if (self.kind == "bytes") != (self.hash == "bytes"):
            raise ValueError("hash is 'bytes' exactly for the bytes tokenizer")
        return self


BYTE_TOKENIZER = TokenizerInfo(kind="bytes", hash="bytes", vocab_size=BYTE_VOCAB, eos_id=ord("\n"))


class Shard(_Strict):
    file: Annotated[str, Field(pattern=r"^(train|validation)-\d{5}\.bin$")]
    sha256: Sha256
    tokens: Annotated[int, Field(ge=1)]


class SourceEntry(_Strict):
    path: str = Field(description="as the inputs named it: the input, then the file's path under it")
    kind: Kind
    bytes: Annotated[int, Field(ge=0)]


class Manifest(_Strict):
    format: Literal[1] = 1
    tokenizer: TokenizerInfo
    dtype: Dtype
    shard_tokens: Annotated[int, Field(ge=1)]
    train: Annotated[list[Shard], Field(min_length=1)]
    validation: Annotated[list[Shard], Field(min_length=1)]
    documents: Annotated[int, Field(ge=1)]
    tokens: Annotated[int, Field(ge=2)]
    bytes_read: Annotated[int, Field(ge=0)]
    sources: list[SourceEntry]

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        needed = dtype_for(self.tokenizer.vocab_size)
        if self.dtype != needed:
            raise ValueError(
                f"dtype is {self.dtype}; a vocabulary of {self.tokenizer.vocab_size} needs {needed}"
            )
        for split in (self.train, self.validation):
            if any(s.tokens != self.shard_tokens for s in split[:-1]) or split[-1].tokens > self.shard_tokens:
                raise ValueError(
                    f"every shard but a split's last has shard_tokens ({self.shard_tokens}) tokens"
                )
        if self.train_tokens + self.validation_tokens != self.tokens:
            raise ValueError(
                f"the shards hold {self.train_tokens + self.validation_tokens} tokens, not {self.tokens}"
            )
        names = [s.file for s in self.train + self.validation]
        if len(set(names)) != len(names):
            raise ValueError("shard file names repeat")
        return self

    @property
    def train_tokens(self) -> int:
        return sum(s.tokens for s in self.train)

    @property
    def validation_tokens(self) -> int:
        return sum(s.tokens for s in self.validation)

    def to_bytes(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: never half a manifest, whatever stops the writer."""
    path = directory / MANIFEST
    write_atomic(path, manifest.to_bytes())
    return path


def read_manifest(directory: Path) -> Manifest:
    """Parse ``manifest.json`` (no shard read); BadRequest naming each bad field."""
    path = Path(directory) / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadRequest(
            f"{directory} has no {MANIFEST}: not a prepared dataset (or its prepare did not finish)"
        ) from None
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from its bytes (a file's, or a blob's); BadRequest naming ``where`` and each bad field."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as err:
        raise BadRequest(f"{where}: {describe_validation_error(err, Manifest)}") from None


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset whose every shard was checked: ``train`` and ``validation`` as read-only memmaps."""

    manifest: Manifest
    train: list[np.memmap]
    validation: list[np.memmap]


def load_manifest(directory: Path) -> Prepared:
    """Read the manifest and every shard it names, checking each shard's hash (HashMismatch names it)."""
    manifest = read_manifest(directory)

    def opened(split: list[Shard]) -> list[np.memmap]:
        return [open_shard(Path(directory) / s.file, s, manifest.dtype) for s in split]

    return Prepared(manifest, opened(manifest.train), opened(manifest.validation))


def open_shard(path: Path, shard: Shard, dtype: Dtype) -> np.memmap:
    """A shard file as a read-only memmap, once its bytes hash to ``shard.sha256``."""
    try:
        with open(path, "rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        raise BadRequest(f"shard {shard.file} is missing ({path})") from None
    if got != shard.sha256:
        raise HashMismatch(f"shard {shard.file} hashes to {got}, the manifest says {shard.sha256}")
    return map_shard(path, shard, dtype)


def map_shard(path: Path, shard: Shard, dtype: Dtype) -> np.memmap:
    """A shard file whose hash was checked already (``open_shard``, the cache) as a read-only memmap."""
    tokens = np.memmap(path, dtype=numpy_dtype(dtype), mode="r")
    if len(tokens) != shard.tokens:
        raise BadRequest(f"shard {shard.file} holds {len(tokens)} tokens, the manifest says {shard.tokens}")
    return tokens
