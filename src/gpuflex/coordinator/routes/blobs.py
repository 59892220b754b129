"""The content-addressed blob store over HTTP: the body's sha256 must equal the key."""

from fastapi import APIRouter, Request, Response

from gpuflex.coordinator.auth import BlobReader, BlobWriter, Ctx
from gpuflex.coordinator.metrics import Metrics
from gpuflex.storage import validate_digest

router = APIRouter(prefix="/blobs", tags=["blobs"])


@router.put(
    "/{digest}",
    status_code=201,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def put_blob(
    digest: str, request: Request, _who: BlobWriter, ctx: Ctx, metrics: Metrics
) -> dict[str, str]:
    """Upload a blob (at most ``max_blob_bytes``; larger bodies get 413)."""
    validate_digest(digest)
    body = await request.body()
    ctx.blobs.put(body, expected=digest)
    metrics.bytes_in.inc(len(body))
    return {"sha256": digest}


@router.get(
    "/{digest}", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}}
)
def get_blob(digest: str, _who: BlobReader, ctx: Ctx, metrics: Metrics) -> Response:
    data = ctx.blobs.get(validate_digest(digest))
    metrics.bytes_out.inc(len(data))
    return Response(data, media_type="application/octet-stream")
