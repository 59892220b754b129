"""The content-addressed blob store over HTTP: the body's sha256 must equal the key.

``POST /blobs/missing`` says which of a list of keys the store lacks, in one round trip, so a client
uploads only those (a prepared dataset's shards: a second job on the same data, or an upload resumed
after an interruption, sends nothing twice). Whoever may add a blob may ask; what it learns is whether
bytes it can name by their hash are here, which only someone who holds (or guessed) them can ask about.
"""

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from gpuflex.coordinator.auth import BlobReader, BlobWriter, Ctx
from gpuflex.coordinator.metrics import Metrics
from gpuflex.coordinator.routes import errors, unstated
from gpuflex.protocol import messages as m

router = APIRouter(prefix="/blobs", tags=["blobs"])

# Checked again by the store itself: a key that is not 64 hex digits never reaches a path.
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the blob's sha256, lower-case hex")]


@router.post("/missing")
def missing_blobs(body: m.BlobKeys, _who: BlobWriter, ctx: Ctx) -> m.MissingBlobs:
    """The keys of ``body`` the store does not hold, in their order (at most ``MAX_BLOB_KEYS`` a call),
    and the largest blob it takes, so a client refuses a larger one before uploading anything."""
    keys = [k for k in dict.fromkeys(body.keys) if not ctx.blobs.exists(k)]
    return m.MissingBlobs(keys=keys, max_blob_bytes=ctx.settings.max_blob_bytes)


@router.put(
    "/{digest}",
    status_code=201,
    responses=unstated(400, "the body's sha256 is not the digest"),
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def put_blob(
    digest: Digest, request: Request, _who: BlobWriter, ctx: Ctx, metrics: Metrics
) -> dict[str, str]:
    """Upload a blob (at most ``max_blob_bytes``; larger bodies get 413)."""
    body = await request.body()
    ctx.blobs.put(body, expected=digest)
    metrics.bytes_in.inc(len(body))
    return {"sha256": digest}


@router.get(
    "/{digest}",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, **errors(404)},
)
def get_blob(digest: Digest, _who: BlobReader, ctx: Ctx, metrics: Metrics) -> Response:
    data = ctx.blobs.get(digest)
    metrics.bytes_out.inc(len(data))
    return Response(data, media_type="application/octet-stream")
