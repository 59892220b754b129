"""The content-addressed blob store over HTTP: the body's sha256 must equal the key.

Blobs stream both ways, so the coordinator holds about one chunk of a transfer whatever the blob's size:
an upload is hashed and counted as it arrives (413 past the limit, 400 if it does not hash to its key,
and nothing stored either way); a download is read from the store a chunk at a time, and a single
``Range: bytes=a-b`` (``a-``, ``-n``) asks for part of it (206), so an interrupted download resumes where
it stopped. A range that starts past the end is a 416; any other Range header (several ranges, not
bytes) is ignored, as HTTP allows, and the whole blob sent.

``POST /blobs/missing`` says which of a list of keys the store lacks, in one round trip, so a client
uploads only those (a prepared dataset's shards: a second job on the same data, or an upload resumed
after an interruption, sends nothing twice). Whoever may add a blob may ask; what it learns is whether
bytes it can name by their hash are here, which only someone who holds (or guessed) them can ask about.
"""

import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from gpuflex.coordinator.auth import BlobReader, BlobUploader, BlobWriter, Ctx
from gpuflex.coordinator.metrics import CoordinatorMetrics, Metrics
from gpuflex.coordinator.routes import errors
from gpuflex.errors import RangeNotSatisfiable
from gpuflex.protocol import messages as m
from gpuflex.storage import BlobStore

router = APIRouter(prefix="/blobs", tags=["blobs"])

# Checked again by the store itself: a key that is not 64 hex digits never reaches a path.
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the blob's sha256, lower-case hex")]
ByteRange = Annotated[
    str | None, Header(alias="Range", description="one range of bytes: `bytes=a-b`, `bytes=a-` or `bytes=-n`")
]

READ_CHUNK = 1 << 20  # bytes read from the store at a time for a download
_ONE_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")


@router.post("/missing")
def missing_blobs(body: m.BlobKeys, _who: BlobWriter, ctx: Ctx) -> m.MissingBlobs:
    """The keys of ``body`` the store does not hold, in their order (at most ``MAX_BLOB_KEYS`` a call),
    and the largest blob it takes, so a client refuses a larger one before uploading anything."""
    keys = [k for k in dict.fromkeys(body.keys) if not ctx.blobs.exists(k)]
    return m.MissingBlobs(keys=keys, max_blob_bytes=ctx.settings.max_blob_bytes)


@router.put(
    "/{digest}",
    status_code=201,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def put_blob(
    digest: Digest, request: Request, _who: BlobUploader, ctx: Ctx, metrics: Metrics
) -> dict[str, str]:
    """Upload a blob (at most ``max_blob_bytes``; larger bodies get 413), streamed into the store."""
    with ctx.blobs.upload(digest, limit=ctx.settings.max_blob_bytes) as upload:
        async for chunk in request.stream():
            upload.write(chunk)
        await run_in_threadpool(upload.finish)
    metrics.bytes_in.inc(upload.size)
    return {"sha256": digest}


@router.get(
    "/{digest}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        206: {"content": {"application/octet-stream": {}}, "description": "the range asked for"},
        **errors(404, 416),
    },
)
def get_blob(
    digest: Digest, _who: BlobReader, ctx: Ctx, metrics: Metrics, range_: ByteRange = None
) -> Response:
    size = ctx.blobs.size(digest)
    span = requested_span(range_, size)
    start, stop = span or (0, size)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(stop - start)}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    return StreamingResponse(
        _read(ctx.blobs, digest, start, stop, metrics),
        status_code=200 if span is None else 206,
        media_type="application/octet-stream",
        headers=headers,
    )


def requested_span(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes ``[start, stop)`` of a blob of ``size`` that a Range header asks for; None for the whole
    blob (no header, or one this route ignores). RangeNotSatisfiable if the range starts past the end."""
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
