"""Where a dataset's documents come from: text files, JSON Lines, Parquet and Arrow, on any fsspec URL.

An input is a path or URL (``corpus/``, ``memory://c/a.jsonl``, ``s3://bucket/part-*.parquet``), a glob,
or a directory; several inputs are read in the order given, the files of each in sorted order, so the
same inputs always give the same documents in the same order (and so the same token shards). A file is
read by its suffix:

- ``.jsonl`` / ``.ndjson``: one JSON object per line, the document its ``field`` (blank lines skipped);
- ``.parquet``: the ``column`` of every row, read a batch of rows at a time, never the whole file;
- ``.arrow``: an Arrow IPC stream (what ``datasets`` writes), the ``column`` of every row;
- anything else: UTF-8 text, the whole file one document.

A directory is every file under it (hidden ones skipped), except a ``datasets`` ``save_to_disk``
directory (``state.json``), which is its own Arrow files, read with pyarrow so that users need not
install ``datasets``. Bad input is one ``BadRequest`` naming the file (and line or row).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from gpuflex.data.manifest import Kind
from gpuflex.errors import BadRequest

_SUFFIXES: dict[str, Kind] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_MAGIC = re.compile(r"[*?\[]")
_JSON_TYPES = {dict: "an object", list: "an array", int: "a number", float: "a number", bool: "a boolean"}
BATCH_BYTES = 1 << 20  # text per batch: enough documents for the tokenizer's threads, little memory
_ROWS_PER_READ = 4096  # Parquet rows decoded at once


@dataclass(frozen=True)
class SourceFile:
    """One file to read: ``name`` is how the user addresses it (the input it matched, then its relative
    path), ``path`` how its file system does."""

    fs: AbstractFileSystem
    path: str
    name: str
    kind: Kind
    size: int


@dataclass(frozen=True)
class TextBatch:
    """Consecutive documents, and the bytes of input read since the previous batch (for progress)."""

    documents: list[str]
    bytes_read: int


class Source:
    """The files that ``inputs`` name, resolved and checked (Parquet and Arrow schemas) before any is read."""

    def __init__(self, inputs: Sequence[str], *, field: str = "text", column: str = "text"):
        if not inputs:
            raise BadRequest("no input given: name files, directories, globs or URLs")
        self.field = field
        self.column = column
        seen: set[str] = set()
        self.files: list[SourceFile] = []
        for text in inputs:
            for file in _expand(text):
                key = file.fs.unstrip_protocol(file.path)
                if key not in seen:  # a file two inputs match is read once, where it first appeared
                    seen.add(key)
                    self.files.append(file)
        for file in self.files:
            if file.kind in ("parquet", "arrow"):
                _check_column(file, column)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def batches(self, batch_bytes: int = BATCH_BYTES) -> Iterator[TextBatch]:
        """The documents in order, in batches of about ``batch_bytes`` of text (batches span files)."""
        documents: list[str] = []
        size = read = 0
        for file in self.files:
            for chunk, chunk_read in _read(file, self.field, self.column, batch_bytes):
                documents += chunk
                size += sum(len(d) for d in chunk)
                read += chunk_read
                if size >= batch_bytes:
                    yield TextBatch(documents, read)
                    documents, size, read = [], 0, 0
        if documents or read:
            yield TextBatch(documents, read)


def _expand(text: str) -> list[SourceFile]:
    """The files one input names, sorted; BadRequest if it names none."""
    fs, path = url_to_fs(text)
    if _MAGIC.search(path):
        base, typed_base = _static_dir(path), _static_dir(text)
        matches = sorted(fs.glob(path))
        if not matches:
            raise BadRequest(f"no input matched {text!r}")
    elif fs.isdir(path):
        base, typed_base, matches = path, text.rstrip("/"), [path]
    elif fs.exists(path):
        return [_file(fs, path, text)]
    else:
        raise BadRequest(f"no such file or directory: {text!r}")
    files = []
    for match in matches:
        members = _directory(fs, match) if fs.isdir(match) else [match]
        for member in members:
            rel = posixpath.relpath(member, base)
            files.append(_file(fs, member, posixpath.join(typed_base, rel) if typed_base else rel))
    if not files:
        raise BadRequest(f"no files under {text!r}")
    return files


def _static_dir(path: str) -> str:
    """The directory part of a glob before its first wildcard: ``corpus`` of ``corpus/*/a.jsonl``."""
    wildcard = _MAGIC.search(path)
    assert wildcard, f"{path} is not a glob"
    return path[: path.rfind("/", 0, wildcard.start()) + 1].rstrip("/")


def _directory(fs: AbstractFileSystem, path: str) -> list[str]:
    """The files a directory stands for: a ``datasets`` directory's Arrow files, else its non-hidden files."""
    state = posixpath.join(path, "state.json")
    if fs.exists(state):
        return [posixpath.join(path, f["filename"]) for f in _datasets_files(fs, state)]
    if fs.exists(posixpath.join(path, "dataset_dict.json")):
        splits = json.loads(fs.cat_file(posixpath.join(path, "dataset_dict.json"))).get("splits", [])
        raise BadRequest(
            f"{path} holds a DatasetDict (splits: {', '.join(splits)}): name one split's directory, "
            f"e.g. {posixpath.join(path, splits[0] if splits else 'train')}"
        )
    found = fs.find(path)
    return sorted(
        p for p in found if not any(part.startswith(".") for part in posixpath.relpath(p, path).split("/"))
    )


def _datasets_files(fs: AbstractFileSystem, state: str) -> list[dict]:
    try:
        return json.loads(fs.cat_file(state))["_data_files"]
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequest(f"{state} is not a datasets state.json (no _data_files: {err})") from None


def _file(fs: AbstractFileSystem, path: str, name: str) -> SourceFile:
    suffix = posixpath.splitext(path)[1].lower()
    return SourceFile(fs, path, name, _SUFFIXES.get(suffix, "text"), int(fs.size(path) or 0))


def _check_column(file: SourceFile, column: str) -> None:
    with file.fs.open(file.path, "rb") as f, _readable(file):
        schema = pq.ParquetFile(f).schema_arrow if file.kind == "parquet" else pa.ipc.open_stream(f).schema
    if column not in schema.names:
        raise BadRequest(
            f"{file.name} has no column {column!r} (its columns: {', '.join(schema.names)}); "
            "choose one with --column"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise BadRequest(f"{file.name}: column {column!r} holds {kind}, not text")


@contextmanager
def _readable(file: SourceFile) -> Iterator[None]:
    """pyarrow's errors about a file (not Parquet, truncated, not an IPC stream) as one line naming it."""
    try:
        yield
    except pa.ArrowException as err:
        raise BadRequest(f"{file.name} is not a readable {file.kind} file: {err}") from None


def _read(file: SourceFile, field: str, column: str, batch_bytes: int) -> Iterator[tuple[list[str], int]]:
    """A file's documents in chunks, each with the bytes of the file read for it."""
    with file.fs.open(file.path, "rb") as f, _readable(file):
        if file.kind == "jsonl":
            yield from _read_jsonl(file, f, field, batch_bytes)
        elif file.kind == "parquet":
            yield from _read_parquet(file, f, column)
        elif file.kind == "arrow":
            yield from _read_arrow(file, f, column)
        else:
            data = f.read()
            try:
                yield [data.decode("utf-8")], len(data)
            except UnicodeDecodeError as err:
                raise BadRequest(
                    f"{file.name} is not UTF-8 text (byte {err.start}); name the files to read with a glob, "
                    "e.g. 'corpus/**/*.txt'"
                ) from None


def _read_jsonl(
    file: SourceFile, f: IO[bytes], field: str, batch_bytes: int
) -> Iterator[tuple[list[str], int]]:
    documents: list[str] = []
    read = 0
    for number, line in enumerate(f, 1):
        read += len(line)
        if line.isspace():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise BadRequest(f"{file.name} line {number}: not JSON ({err})") from None
        if not isinstance(record, dict):
            raise BadRequest(f"{file.name} line {number}: {_json_type(record)}, not an object with {field!r}")
        if field not in record:
            raise BadRequest(
                f"{file.name} line {number}: no field {field!r} (it has: {', '.join(record) or 'none'}); "
                "choose one with --field"
            )
        text = record[field]
        if not isinstance(text, str):
            raise BadRequest(
                f"{file.name} line {number}: field {field!r} is {_json_type(text)}, not a string"
            )
        documents.append(text)
        if read >= batch_bytes:
            yield documents, read
            documents, read = [], 0
    yield documents, read


def _json_type(value: object) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _read_parquet(file: SourceFile, f: IO[bytes], column: str) -> Iterator[tuple[list[str], int]]:
    parquet = pq.ParquetFile(f)
    rows, done, reported = parquet.metadata.num_rows, 0, 0
    for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ, columns=[column]):
        documents = _texts(file, batch.column(0), done)
        done += len(documents)
        size = file.size * done // rows  # the file's bytes in proportion to its rows: exact at the end
        yield documents, size - reported
        reported = size


def _read_arrow(file: SourceFile, f: IO[bytes], column: str) -> Iterator[tuple[list[str], int]]:
    stream = pa.ipc.open_stream(f)
    index, done, reported = stream.schema.get_field_index(column), 0, 0
    for batch in stream:
        documents = _texts(file, batch.column(index), done)
        done += len(documents)
        yield documents, f.tell() - reported
        reported = f.tell()
    yield [], file.size - reported  # the stream's end marker


def _texts(file: SourceFile, values: pa.Array, first_row: int) -> list[str]:
    if values.null_count:
        row = first_row + pc.index(values.is_null(), True).as_py()
        raise BadRequest(f"{file.name} row {row}: the column is null, not text")
    return values.to_pylist()
