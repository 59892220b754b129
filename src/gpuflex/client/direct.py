"""Blob bytes moved straight to or from an object store, by URLs the coordinator signed.

A presigned URL is a credential of its own, so it is used without this API's headers: a bearer token or
a node's signature must not reach a third party, and S3 refuses a request authenticated twice. Whoever
served the bytes, a read is checked against the sha256 it was asked by. An upload asks the coordinator
where to go first (``POST /v1/blobs/uploads``): nowhere if the store holds it, the coordinator itself if
its store signs no URLs, else the store, after which the coordinator has the store check and file it.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import TYPE_CHECKING

import httpx

from gpuflex.errors import GPUFlexError, HashMismatch, ServiceError, from_status
from gpuflex.protocol import messages as m

if TYPE_CHECKING:
    from gpuflex.client.http import HttpSession

TIMEOUT_S = 120.0


def fetch(url: str, digest: str, *, retry_for_s: float = 0.0) -> bytes:
    """Blob ``digest`` from a presigned GET ``url``, checked."""
    response = _send("GET", url, digest, retry_for_s=retry_for_s)
    if hashlib.sha256(response.content).hexdigest() != digest:
        raise HashMismatch(f"blob {digest} arrived corrupted from the object store")
    return response.content


def upload(http: HttpSession, data: bytes) -> str:
    """Store ``data`` as a blob wherever the coordinator says; its sha256."""
    digest = hashlib.sha256(data).hexdigest()
    body = m.BlobUpload(sha256=digest, length=len(data)).model_dump()
    ticket = m.UploadTicket.model_validate(http.request("POST", "/v1/blobs/uploads", json=body).json())
    if ticket.present:
        return digest
    if ticket.url is None:
        http.request("PUT", f"/v1/blobs/{digest}", content=data)
        return digest
    _send("PUT", ticket.url, digest, retry_for_s=http.retry_for_s, content=data, headers=ticket.headers)
    done = m.UploadDone(sha256=digest, upload=ticket.upload).model_dump()
    http.request("POST", "/v1/blobs/uploads/done", json=done)
    return digest


def _send(method: str, url: str, digest: str, *, retry_for_s: float, **kwargs) -> httpx.Response:
    """One request to the store. A connection failure or a 5xx (S3's ``SlowDown``, ``InternalError``)
    is tried again for up to ``retry_for_s`` seconds, as the caller's calls to the coordinator are."""
    deadline = time.monotonic() + retry_for_s
    delay = 0.2
    while True:
        try:
            response = httpx.request(method, url, timeout=TIMEOUT_S, **kwargs)
        except httpx.TransportError as err:
            if time.monotonic() >= deadline:
                raise ServiceError(f"cannot reach the object store for blob {digest}: {err}") from None
        else:
            if response.is_success:
                return response
            if response.status_code < 500 or time.monotonic() >= deadline:
                raise _refused(response, f"{method} of blob {digest}")
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def _refused(response: httpx.Response, what: str) -> GPUFlexError:
    """The store's own reason, from S3's error document (``<Code>``, ``<Message>``): an expired URL is
    ``AccessDenied: Request has expired``, a body that is not the one signed for ``BadDigest`` or
    ``SignatureDoesNotMatch``."""
    words = [re.search(f"<{tag}>(.*?)</{tag}>", response.text, re.S) for tag in ("Code", "Message")]
    reason = ": ".join(w.group(1).strip() for w in words if w) or response.reason_phrase
    return from_status(
        response.status_code, f"the object store refused the {what}: {reason} (HTTP {response.status_code})"
    )
