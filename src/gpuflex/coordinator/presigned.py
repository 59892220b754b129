"""The coordinator's side of direct transfers: on a store that signs URLs (S3), an authorized caller is
sent to the store with a short-lived URL instead of its bytes passing through here.

Routes call these after the same checks that guard the bytes (``auth.BlobReader``, ``BlobWriter``, a
job's owner), so a URL is only ever signed for someone who could have had the bytes from us. A URL is
good for one key and one method until ``blob_url_ttl_s`` from now; an upload's also for one length and
one sha256. ``gpuflex_blob_bytes_signed`` counts what was signed for, which never crosses this process.
"""

from __future__ import annotations

import time

from fastapi.responses import RedirectResponse

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.errors import PayloadTooLarge
from gpuflex.protocol import messages as m

# OpenAPI for a GET that may answer with the store's URL instead of the bytes
REDIRECT = {
    307: {
        "description": "the blob is in an object store: GET the presigned Location without this API's "
        "credentials, and check its sha256",
        "headers": {"Location": {"schema": {"type": "string"}, "description": "a presigned GET URL"}},
    }
}


def redirect(
    ctx: CoordinatorContext, metrics: CoordinatorMetrics, digest: str, headers: dict[str, str] | None = None
) -> RedirectResponse | None:
    """A 307 to a presigned GET of blob ``digest``, or None where the store signs no URLs."""
    signed = ctx.blobs.presign_get(digest, _expiry(ctx))
    if signed is None:
        return None
    metrics.bytes_signed.labels("out").inc(signed.length)
    headers = {"Cache-Control": "no-store", **(headers or {})}
    return RedirectResponse(signed.url, status_code=307, headers=headers)


def ticket(ctx: CoordinatorContext, metrics: CoordinatorMetrics, body: m.BlobUpload) -> m.UploadTicket:
    """Where the bytes of ``body``'s blob go: nowhere if the store has it, else a presigned PUT, else us."""
    limit = ctx.settings.max_blob_bytes
    if body.length > limit:
        raise PayloadTooLarge(f"a blob of {body.length} bytes is over this coordinator's limit of {limit}")
    if ctx.blobs.exists(body.sha256):
        return m.UploadTicket(present=True)
    signed = ctx.blobs.presign_put(body.sha256, body.length, _expiry(ctx))
    if signed is None:
        return m.UploadTicket(present=False)
    metrics.bytes_signed.labels("in").inc(body.length)
    return m.UploadTicket(
        present=False,
        url=signed.url,
        headers=signed.headers,
        expires_at=signed.expires_at,
        upload=signed.upload,
    )


def _expiry(ctx: CoordinatorContext) -> float:
    # the store checks a URL's expiry against its own wall clock, so this is wall time, not ctx.now()
    return time.time() + ctx.settings.blob_url_ttl_s
