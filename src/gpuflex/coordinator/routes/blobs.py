"""The content-addressed blob store over HTTP: the body's sha256 must equal the key.

Blobs stream both ways, so the coordinator holds about one chunk of a transfer whatever the blob's size:
an upload is hashed and counted as it arrives (413 past the limit, 400 if it does not hash to its key,
and nothing stored either way); a download is read from the store a chunk at a time and takes one byte
range (``coordinator.downloads``), so an interrupted download resumes where it stopped.

``POST /blobs/missing`` says which of a list of keys the store lacks, in one round trip, so a client
uploads only those (a prepared dataset's shards: a second job on the same data, or an upload resumed
after an interruption, sends nothing twice). Whoever may add a blob may ask; what it learns is whether
bytes it can name by their hash are here, which only someone who holds (or guessed) them can ask about.
"""

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from gpuflex.coordinator.auth import BlobReader, BlobUploader, BlobWriter, Ctx
from gpuflex.coordinator.downloads import streamed_blob
from gpuflex.coordinator.metrics import Metrics
from gpuflex.coordinator.routes import errors
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/blobs", tags=["blobs"])

# Checked again by the store itself: a key that is not 64 hex digits never reaches a path.
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the blob's sha256, lower-case hex")]
ByteRange = Annotated[
    str | None, Header(alias="Range", description="one range of bytes: `bytes=a-b`, `bytes=a-` or `bytes=-n`")
]


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
    """The blob, streamed; one byte range of it if ``Range`` asks (206; 416 past its end)."""
    return streamed_blob(ctx.blobs, digest, metrics, range_)
