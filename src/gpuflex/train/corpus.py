"""Builds a job's training text from the Python standard library or a directory of the user's.

It owns the choice of files and their order, so the same source always gives the same bytes
(and so the same dataset hash). It imports no torch: the CLI calls it before a job is submitted.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from gpuflex.errors import BadRequest

MIN_BYTES = 10_000  # less text than this is a mistake (an empty or wrong directory), not a corpus
STDLIB = "stdlib"
_STDLIB_SKIP = frozenset({"site-packages", "test", "tests", "__pycache__"})  # not the library's own code


def build_corpus(source: str, max_bytes: int, extensions: list[str]) -> bytes:
    """Concatenate the matching UTF-8 files under ``source``, sorted by relative path, up to ``max_bytes``.

    ``source`` is ``"stdlib"`` (this interpreter's standard library, without its tests and
    site-packages) or a directory. Files are separated by a newline; files that are not valid
    UTF-8 are skipped. Raises BadRequest if there is no such directory or too little text in it.
    """
    if max_bytes < MIN_BYTES:
        raise BadRequest(f"max_bytes must be at least {MIN_BYTES}, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"]) if source == STDLIB else Path(source).expanduser()
    if not root.is_dir():
        raise BadRequest(f"corpus source {source!r} is not a directory")
    skip = _STDLIB_SKIP if source == STDLIB else frozenset()
    suffixes = tuple(e if e.startswith(".") else f".{e}" for e in extensions)
    paths = _matching_files(root, suffixes, skip)
    if not paths:
        raise BadRequest(f"no files ending in {', '.join(suffixes) or '(nothing)'} under {root}")
    corpus = _concatenate(root, paths, max_bytes)
    if len(corpus) < MIN_BYTES:
        raise BadRequest(
            f"only {len(corpus)} bytes of UTF-8 text in {len(paths)} file(s) under {root}; "
            f"a corpus needs at least {MIN_BYTES}"
        )
    return corpus


def _matching_files(root: Path, suffixes: tuple[str, ...], skip: frozenset[str]) -> list[str]:
    """Relative POSIX paths of the files under ``root`` with one of ``suffixes``, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow directory symlinks: no loops
        dirnames[:] = [d for d in dirnames if d not in skip]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(suffixes)]
    return sorted(found)


def _concatenate(root: Path, paths: list[str], max_bytes: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    for rel in paths:
        try:
            data = (root / rel).read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(data)
        size += len(data) + 1
        if size >= max_bytes:
            break
    return b"\n".join(parts)[:max_bytes]
