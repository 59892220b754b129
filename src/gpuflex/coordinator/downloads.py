"""A stored blob as an HTTP answer, streamed from the store a chunk at a time (the coordinator holds
about one chunk of a download whatever the blob's size), its bytes counted as they go out.

A single ``Range: bytes=a-b`` (``a-``, ``-n``) asks for part of a blob (206 with ``Content-Range``), so an
interrupted download resumes where it stopped; a range that starts past the end is a 416; any other
Range header (several ranges, another unit, no numbers) is ignored, as HTTP allows, and the whole blob
sent.
"""

import re
from collections.abc import Iterator

from fastapi.responses import StreamingResponse

from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.errors import RangeNotSatisfiable
from gpuflex.storage import BlobStore

READ_CHUNK = 1 << 20  # bytes read from the store at a time
_ONE_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")


def streamed_blob(
    store: BlobStore,
    digest: str,
    metrics: CoordinatorMetrics,
    range_header: str | None = None,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """Blob ``digest`` (NotFound if the store lacks it), or the range ``range_header`` asks for, with
    ``headers`` besides its own."""
    size = store.size(digest)
    span = requested_span(range_header, size)
    start, stop = span or (0, size)
    headers = {**(headers or {}), "Accept-Ranges": "bytes", "Content-Length": str(stop - start)}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    return StreamingResponse(
        _read(store, digest, start, stop, metrics),
        status_code=200 if span is None else 206,
        media_type="application/octet-stream",
        headers=headers,
    )


def requested_span(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes ``[start, stop)`` of a blob of ``size`` that a Range header asks for; None for the whole
    blob (no header, or one that is ignored). RangeNotSatisfiable if the range starts past the end."""
    match = _ONE_RANGE.fullmatch(header.strip()) if header else None
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if not first:  # a suffix: the last n bytes
        if int(last) == 0:
            raise RangeNotSatisfiable("a range of the last 0 bytes is empty")
        start, stop = max(size - int(last), 0), size
        return (start, stop) if start < stop else None
    start = int(first)
    if last and int(last) < start:  # not a range: ignored
        return None
    if start >= size:
        raise RangeNotSatisfiable(f"the range starts at byte {start}; the blob has {size} bytes")
    return start, min(int(last) + 1, size) if last else size


def _read(
    store: BlobStore, digest: str, start: int, stop: int, metrics: CoordinatorMetrics
) -> Iterator[bytes]:
    """Bytes ``[start, stop)`` of the blob, a chunk at a time, counted as they go out."""
    with store.open(digest) as blob:
        blob.seek(start)
        while start < stop and (chunk := blob.read(min(READ_CHUNK, stop - start))):
            start += len(chunk)
            metrics.bytes_out.inc(len(chunk))
            yield chunk
