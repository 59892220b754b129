"""One HTTP session to the coordinator: errors become ``gpuflex.errors``, brief outages are retried.

A URL may name several coordinator processes of one network, comma-separated (``http://a:8750,http://
b:8750``): calls go to one, and to the next from the first that cannot be reached (a process that died),
so a provider's agent and its tasks reconnect to a live one by themselves.

Over ``https://`` the coordinator's certificate is verified against the system's CAs, or against ``ca``
(a PEM file) alone when given: a coordinator whose certificate a private CA signed (``gpuflex coordinator
serve --tls-cert``) is reached with ``--ca`` naming that CA, and one signed by any other CA is refused.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from gpuflex.client import direct
from gpuflex.errors import BadRequest, HashMismatch, ServiceError, from_status

RETRYABLE_STATUS = {502, 503, 504}
RESUMES = 4  # a download cut off mid-body is resumed from where it stopped at most this many times


class HttpSession:
    """Requests to one coordinator (one of ``base_url``'s, comma-separated). ``sign`` adds headers
    computed from (method, path, body)."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        sign: Callable[[str, str, bytes], dict[str, str]] | None = None,
        timeout_s: float = 30.0,
        retry_for_s: float = 0.0,
        transport: httpx.BaseTransport | None = None,
        ca: str | Path | None = None,
    ):
        self.urls = [url.strip().rstrip("/") for url in base_url.split(",") if url.strip()]
        if not self.urls:
            raise BadRequest("no coordinator URL given")
        self.sign = sign
        self.retry_for_s = retry_for_s
        self._current = 0
        self._http = httpx.Client(
            headers=headers or {},
            timeout=timeout_s,
            transport=transport,
            verify=trusting(ca),
        )

    @property
    def base_url(self) -> str:
        """The coordinator calls go to now."""
        return self.urls[self._current]

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        content: bytes | None = None,
        params: dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request; retry connection failures and 5xx for up to ``retry_for_s`` seconds."""
        return self._request(method, path, json, content, params, headers, stream=False)

    @contextmanager
    def stream(
        self, method: str, path: str, *, headers: dict[str, str] | None = None
    ) -> Iterator[httpx.Response]:
        """``request`` whose body is read as it arrives (``iter_bytes``); closed on leaving."""
        response = self._request(method, path, None, None, None, headers, stream=True)
        try:
            yield response
        finally:
            response.close()

    def _request(self, method, path, json, content, params, headers, *, stream: bool) -> httpx.Response:
        deadline = time.monotonic() + self.retry_for_s
        delay = 0.2
        untried = len(self.urls) - 1  # the other coordinators, each tried at once on a failure
        while True:
            try:
                response = self._send(method, path, json, content, params, headers, stream)
            except httpx.TransportError as err:
                if _untrusted(err):  # retrying will not make the certificate trusted
                    raise ServiceError(
                        f"cannot reach the coordinator at {self.base_url}: its TLS certificate is not "
                        f"trusted ({_untrusted(err)}); pass the CA that signed it with --ca FILE "
                        "(or GPUFLEX_CA)"
                    ) from None
                failed, self._current = self.base_url, (self._current + 1) % len(self.urls)
                if untried:
                    untried -= 1
                    continue
                if time.monotonic() >= deadline:
                    raise ServiceError(f"cannot reach the coordinator at {failed}: {err}") from None
            else:
                if response.status_code not in RETRYABLE_STATUS or time.monotonic() >= deadline:
                    return _checked(response)
                response.close()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)  # a restarted coordinator is back within a second of it

    def _send(self, method, path, json, content, params, headers, stream) -> httpx.Response:
        url = self.base_url + path
        request = self._http.build_request(
            method, url, json=json, content=content, params=params, headers=headers
        )
        if self.sign is not None:
            target = request.url.raw_path.decode()
            request.headers.update(self.sign(method, target, request.read()))
        return self._http.send(request, stream=stream)


def trusting(ca: str | Path | None) -> ssl.SSLContext | bool:
    """What verifies the coordinator's certificate: the CA in ``ca`` alone, else the system's CAs."""
    if ca is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as err:
        raise BadRequest(f"--ca {ca}: not a readable PEM certificate ({err})") from None


def _untrusted(err: httpx.TransportError) -> str | None:
    """The verification failure behind ``err``, if that is what it is."""
    cause = err.__context__ or err.__cause__
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__context__ or cause.__cause__
    return cause.verify_message if cause is not None else None


def _checked(response: httpx.Response) -> httpx.Response:
    if response.is_success or response.is_redirect:  # a blob's presigned URL: see ``client.direct``
        return response
    response.read()  # a streamed response's error body
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text or response.reason_phrase
    if response.status_code == 404 and detail in (response.reason_phrase, response.text):
        # Not a resource's own 404, which names what is missing: no route answered, so the URL is wrong.
        request = response.request
        detail = f"nothing at {request.method} {request.url}: is the coordinator URL right?"
    # A detail of several lines (a query error's caret line under the query) keeps them intact.
    first, newline, rest = str(detail).partition("\n")
    raise from_status(response.status_code, f"{first} (HTTP {response.status_code}){newline}{rest}")


def get_blob(http: HttpSession, digest: str) -> bytes:
    """A blob by its hash, checked: a task's and a node's read (``HashMismatch`` if it arrived corrupted).

    It streams in, and a connection cut mid-body is resumed with ``Range: bytes=<received>-`` (at most
    ``RESUMES`` times), so a large blob's bytes already here are not fetched again."""
    received, length = bytearray(), None
    for resumes_left in range(RESUMES, -1, -1):
        headers = {"Range": f"bytes={len(received)}-"} if received else None
        try:
            with http.stream("GET", f"/v1/blobs/{digest}", headers=headers) as response:
                if response.is_redirect:  # in an object store: its presigned URL serves the bytes
                    return direct.fetch(response.headers["Location"], digest, retry_for_s=http.retry_for_s)
                if response.status_code != 206:  # the whole blob, from its first byte
                    received.clear()
                length = _blob_length(response)
                for chunk in response.iter_bytes():
                    received += chunk
            break
        except httpx.TransportError as err:
            if len(received) == length:  # cut after its last byte
                break
            if not resumes_left:
                raise ServiceError(
                    f"the download of blob {digest} was cut off {RESUMES + 1} times: {err}"
                ) from None
    data = bytes(received)
    if hashlib.sha256(data).hexdigest() != digest:
        raise HashMismatch(f"blob {digest} arrived corrupted")
    return data


def _blob_length(response: httpx.Response) -> int | None:
    """The whole blob's length as a (partial) response states it, if it does."""
    whole = response.headers.get("content-range", "").rpartition("/")[2]
    stated = whole or response.headers.get("content-length", "")
    return int(stated) if stated.isdigit() else None
