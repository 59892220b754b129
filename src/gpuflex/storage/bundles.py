"""A directory of files as content-addressed blobs: a model directory on its way to the providers.

Each file is cut into parts of at most ``part_bytes`` (the blob store's limit), each part a blob named
by its sha256; a file that fits is one part, whose key is the file's own hash. The ``Bundle`` manifest
lists every file with its size, its sha256 and its parts, and is itself a blob (``Bundle.to_bytes``; its
hash is what a job names)::

    bundle, parts = bundle_directory(Path("my-model"), part_bytes=64 << 20)   # hashes, reads nothing twice
    for part in parts: upload(part.read())        # one part in memory at a time, never a whole file
    materialize(bundle, fetch, Path("work/model"))  # on a provider: parts joined, every hash checked

An encrypted job's bundle (``privacy.encrypt``) has each part, and the manifest itself, sealed under the
job's data key: a part names the ciphertext it is stored as (``PartEntry.blob``) beside its plaintext's
hash, and the manifest's hash is its ciphertext's.

Only the files directly in the directory travel (``save_pretrained`` writes no subdirectories); hidden
files are left out. Names are plain file names, checked again on the way in, so a hostile manifest
cannot write outside the directory it is materialized in.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuflex.errors import BadRequest, HashMismatch
from gpuflex.storage.blobs import validate_digest
from gpuflex.storage.fetching import in_order

FORMAT = "gpuflex-bundle/1"
CHUNK = 1 << 20  # bytes read at a time while hashing or joining
MAX_FILES = 10_000
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*$")  # a plain file name: no separator, not hidden

Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
CONFIG = "config.json"
WEIGHTS = ".safetensors"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PartEntry(_Strict):
    sha256: Hex
    size: Annotated[int, Field(ge=0)]
    # the key the part is stored under when that is not its own hash: an encrypted job's (``privacy.encrypt``)
    # is its ciphertext's; ``sha256`` and ``size`` stay the plaintext's, what the opened part is checked by
    blob: Hex | None = None

    @property
    def key(self) -> str:
        return self.blob or self.sha256


class FileEntry(_Strict):
    name: Annotated[str, Field(pattern=_NAME.pattern, max_length=255)]
    size: Annotated[int, Field(ge=0)]
    sha256: Hex
    parts: list[PartEntry]


class Bundle(_Strict):
    format: str = FORMAT
    files: Annotated[list[FileEntry], Field(max_length=MAX_FILES)]

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Bundle:
        try:
            bundle = Bundle.model_validate_json(data)
        except ValidationError as err:
            raise BadRequest(f"not a model manifest: {err.errors()[0]['msg']}") from None
        if bundle.format != FORMAT:
            raise BadRequest(f"model manifest format {bundle.format!r} is not {FORMAT!r}")
        for f in bundle.files:
            if sum(p.size for p in f.parts) != f.size:
                raise BadRequest(f"model manifest: the parts of {f.name} do not add up to its size")
        return bundle

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def digests(self) -> list[str]:
        """Every part's key, each once, in file order."""
        return list(dict.fromkeys(p.key for f in self.files for p in f.parts))

    def stored_as(self, keys: dict[str, str]) -> Bundle:
        """This bundle with each part stored under ``keys[its sha256]`` (an encrypted job's ciphertexts)."""
        files = [
            f.model_copy(update={"parts": [p.model_copy(update={"blob": keys[p.sha256]}) for p in f.parts]})
            for f in self.files
        ]
        return self.model_copy(update={"files": files})


@dataclass(frozen=True)
class Part:
    """Where one part's bytes are on disk: ``read`` them to upload."""

    sha256: str
    path: Path
    offset: int
    size: int

    def read(self) -> bytes:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


def bundle_directory(root: Path, part_bytes: int) -> tuple[Bundle, list[Part]]:
    """The manifest of the files directly in ``root`` and where each of their parts lies (each part's
    key once). Reads every file once, a chunk at a time."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    try:
        paths = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    except OSError as err:
        raise BadRequest(f"cannot read the model directory {root}: {err.strerror}") from None
    files, parts = [], {}
    for path in paths:
        if not _NAME.fullmatch(path.name):
            raise BadRequest(f"{path}: a file name of letters, digits and ._+- travels; rename it")
        entry, located = _hash_file(path, part_bytes)
        files.append(entry)
        parts.update({p.sha256: p for p in located})
    return Bundle(files=files), list(parts.values())


def _hash_file(path: Path, part_bytes: int) -> tuple[FileEntry, list[Part]]:
    whole = hashlib.sha256()
    parts: list[Part] = []
    entries: list[PartEntry] = []
    offset = 0
    with path.open("rb") as f:
        while True:
            part, size = hashlib.sha256(), 0
            while size < part_bytes and (chunk := f.read(min(CHUNK, part_bytes - size))):
                part.update(chunk)
                whole.update(chunk)
                size += len(chunk)
            if size == 0 and entries:
                break
            entries.append(PartEntry(sha256=part.hexdigest(), size=size))
            parts.append(Part(part.hexdigest(), path, offset, size))
            offset += size
            if size < part_bytes:
                break
    return FileEntry(name=path.name, size=offset, sha256=whole.hexdigest(), parts=entries), parts


def materialize(bundle: Bundle, fetch: Callable[[str], bytes], dest: Path) -> Path:
    """Write the bundle's files into ``dest`` (made if missing): each part fetched by its key and checked,
    the parts joined in order, the whole file checked; a file already there with the right hash is kept."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in bundle.files:
        if not _NAME.fullmatch(entry.name):
            raise BadRequest(f"model manifest names a file {entry.name!r}, which is not a plain file name")
        target = dest / entry.name
        if target.is_file() and target.stat().st_size == entry.size and _file_hash(target) == entry.sha256:
            continue
        write_file(entry, fetch, target)
    return dest


def write_file(entry: FileEntry, fetch: Callable[[str], bytes], target: Path) -> None:
    """Join the file's parts (``file_parts``) into ``target``, whole or not at all, its hash checked."""
    tmp = target.with_name(f".{target.name}.part")
    whole = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for data in file_parts(entry, fetch):
                whole.update(data)
                out.write(data)
        if whole.hexdigest() != entry.sha256:
            raise BadRequest(f"{entry.name} joined from its parts does not hash to the manifest's sha256")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def file_parts(entry: FileEntry, fetch: Callable[[str], bytes]) -> Iterator[bytes]:
    """A file's parts in order, each fetched by its key and checked (``FETCH_WORKERS`` fetched at once,
    ahead of the one the caller holds; an encrypted job's ``fetch`` opens it first); the caller checks the
    whole file's hash."""
    keys = [validate_digest(part.key) for part in entry.parts]
    for part, data in zip(entry.parts, in_order(fetch, keys), strict=True):
        if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
            raise HashMismatch(f"a part of {entry.name} arrived corrupted (its sha256 does not match)")
        yield data


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_problem(names: list[str]) -> str | None:
    """Why files named ``names`` are not a model directory that travels (None: they are): a
    ``config.json`` and safetensors weights (a ``.bin`` is a pickle, which no node unpickles)."""
    if CONFIG not in names:
        return f"has no {CONFIG} (save_pretrained writes one)"
    if not any(n.endswith(WEIGHTS) for n in names):
        pickled = (
            " (only safetensors weights travel; a .bin is a pickle)"
            if any(n.endswith(".bin") for n in names)
            else ""
        )
        return f"has no weights (*{WEIGHTS}){pickled}"
    return None
