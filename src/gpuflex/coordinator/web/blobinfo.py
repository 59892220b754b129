"""Sizes and parameter counts of blobs, remembered: a blob is named by its hash, so neither ever changes.

The first look asks the store (a parameter count reads the blob); later looks are a dict hit.
"""

from __future__ import annotations

import threading

from gpuflex.coordinator.web.stats import safetensors_params
from gpuflex.storage import BlobStore

MAX_REMEMBERED = 100_000


class BlobInfo:
    def __init__(self, store: BlobStore):
        self.store = store
        self._sizes: dict[str, int] = {}
        self._params: dict[str, int] = {}
        self._lock = threading.Lock()

    def _remember(self, table: dict[str, int], digest: str, value: int) -> int:
        with self._lock:
            if len(table) >= MAX_REMEMBERED:
                table.clear()
            table[digest] = value
        return value

    def size(self, digest: str | None) -> int:
        """The blob's size in bytes; 0 for no blob or one that is not (or no longer) in the store."""
        if not digest:
            return 0
        if digest in self._sizes:
            return self._sizes[digest]
        if not self.store.exists(digest):
            return 0
        return self._remember(self._sizes, digest, self.store.size(digest))

    def params(self, digest: str | None) -> int:
        """How many numbers a safetensors blob holds (0 if none or not safetensors)."""
        if not digest:
            return 0
        if digest in self._params:
            return self._params[digest]
        if not self.store.exists(digest):
            return 0
        return self._remember(self._params, digest, safetensors_params(self.store.get(digest)))
