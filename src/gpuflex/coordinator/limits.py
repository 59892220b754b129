"""Request body limits, enforced while the body streams in (a missing Content-Length can't dodge it)."""

from __future__ import annotations

import contextlib
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuse bodies over a limit with 413; ``limits`` maps path prefixes to their own limit."""

    def __init__(self, app: ASGIApp, default_limit: int, limits: dict[str, int]):
        self.app = app
        self.default_limit = default_limit
        self.limits = limits

    def _limit_for(self, path: str) -> int:
        return next((n for prefix, n in self.limits.items() if path.startswith(prefix)), self.default_limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reject(send, limit)
            return
        received = 0
        started = rejected = False

        async def limited_receive() -> Message:
            nonlocal received, rejected
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                # Answer now: the app may catch the error below (FastAPI turns any failure to read a
                # body into a 400), and whatever it sends after this is dropped.
                if not started and not rejected:
                    await _reject(send, limit)
                rejected = True
                raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, limited_receive, tracking_send)


async def _reject(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body is larger than {limit} bytes"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
