"""The content-addressed blob store over HTTP: the body's sha256 must equal the key.

Blobs stream both ways, so the coordinator holds about one chunk of a transfer whatever the blob's size:
an upload is hashed and counted as it arrives (413 past the limit, 400 if it does not hash to its key,
and nothing stored either way); a download is read from the store a chunk at a time and takes one byte
range (``coordinator.downloads``), so an interrupted download resumes where it stopped.

``POST /blobs/missing`` says which of a list of keys the store lacks, in one round trip, so a client
uploads only those (a prepared dataset's shards: a second job on the same data, or an upload resumed
after an interruption, sends nothing twice). Whoever may add a blob may ask; what it learns is whether
bytes it can name by their hash are here, which only someone who holds (or guessed) them can ask about.

On an object store that signs URLs (``presigned``), bytes skip the coordinator: a reader's GET is
answered 307 with a presigned URL, and a writer asks ``POST /blobs/uploads`` where to send a blob, PUTs it
to the store and names the upload back (``POST /blobs/uploads/done``), which files it under its key only
once the store's own sha256 of the bytes equals it.
"""

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from gpuflex.coordinator import presigned
from gpuflex.coordinator.auth import BlobReader, BlobUploader, BlobWriter, Ctx
from gpuflex.coordinator.downloads import streamed_blob
from gpuflex.coordinator.metrics import Metrics
from gpuflex.coordinator.routes import errors, unstated
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


@router.post(
    "/uploads",
    responses=unstated(413, "the length is over this coordinator's blob limit (see /blobs/missing)"),
)
def ask_upload(body: m.BlobUpload, _who: BlobWriter, ctx: Ctx, metrics: Metrics) -> m.UploadTicket:
    """Where to send a blob's bytes: nowhere (held already), here (``PUT /blobs/{digest}``), or the
    object store by a presigned PUT bound to the blob's sha256 and length (413 over the blob limit)."""
    return presigned.ticket(ctx, metrics, body)


@router.post(
    "/uploads/done",
    responses={
        **errors(404),
        **unstated(
            400,
            "the store signs no URLs, the upload is not one this coordinator signed, or what was sent came "
            "after its URL expired or is not the length or sha256 signed for",
        ),
    },
)
def finish_upload(body: m.UploadDone, _who: BlobWriter, ctx: Ctx) -> dict[str, str]:
    """File a presigned upload under its key once the store has hashed it: 400 (and the upload deleted)
    if it came after its URL expired or is not the length or sha256 signed for, 404 if nothing came."""
    ctx.blobs.commit_upload(body.sha256, body.upload)
    return {"sha256": body.sha256}


@router.put(
    "/{digest}",
    status_code=201,
    responses=unstated(400, "the body's sha256 is not the digest"),
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
        **presigned.REDIRECT,
        **errors(404, 416),
    },
)
def get_blob(
    digest: Digest, _who: BlobReader, ctx: Ctx, metrics: Metrics, range_: ByteRange = None
) -> Response:
    """The blob, streamed; one byte range of it if ``Range`` asks (206; 416 past its end). In an object
    store that signs URLs, a 307 to it instead."""
    if redirect := presigned.redirect(ctx, metrics, digest):
        return redirect
    return streamed_blob(ctx.blobs, digest, metrics, range_)
