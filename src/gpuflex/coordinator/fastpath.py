"""The heartbeat's fast path: an ASGI layer that answers a good heartbeat without the framework.

Heartbeats are most of the coordinator's traffic. Profiled under load (py-spy), a heartbeat spent about
two thirds of the event loop's time in FastAPI's routing, middleware and dependency solving, and a third
in the one thing it must do: check the Ed25519 signature. This layer does only what a good heartbeat
needs — a body within the limit, a node whose key this replica has read, a valid signature, a rate-limit
token — and queues it on the same ``HeartbeatWriter`` the route uses.

Anything else is handed to the app unchanged (its body replayed), so ``routes.nodes.heartbeat`` stays
the one definition of every refusal: a bad body (422), an unknown node or a bad signature (401), a
rate-limited node (429), a replayed nonce, a database error. A beat the writer refused wrote nothing,
so it too is handed over and refused by the route.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuflex.auth.signing import HEADER_NODE, verify_request
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.heartbeats import HeartbeatWriter
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.ratelimit import RateLimits
from gpuflex.coordinator.services import registry
from gpuflex.errors import Unauthorized
from gpuflex.protocol.messages import API_VERSION, Heartbeat, HeartbeatAck

PATH = f"/{API_VERSION}/nodes/heartbeat"
_JSON = [(b"content-type", b"application/json")]


class HeartbeatFastPath:
    def __init__(
        self,
        app: ASGIApp,
        *,
        ctx: CoordinatorContext,
        writer: HeartbeatWriter,
        limits: RateLimits,
        metrics: CoordinatorMetrics,
    ):
        self.app = app
        self.ctx = ctx
        self.writer = writer
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_heartbeat(scope):
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        received, body = await _read_body(receive, self.ctx.settings.max_request_bytes)
        beat = self._accept(scope, body) if body is not None else None
        ack = await self._write(beat) if beat is not None else None
        if ack is None:  # the app answers, from the start of the body
            await self.app(scope, _replay(received, receive), send)
            return
        payload = ack.model_dump_json().encode()
        headers = [*_JSON, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        self.metrics.heartbeats.inc()
        self.metrics.request_seconds.labels(PATH, "POST", "200").observe(time.perf_counter() - began)

    def _accept(self, scope: Scope, body: bytes) -> registry.Beat | None:
        """The heartbeat to write, or None if anything about it is for the app to judge."""
        headers = Headers(scope=scope)
        if headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return None
        node_id = headers.get(HEADER_NODE, "")
        public_key = self.ctx.node_keys.get(node_id)
        if public_key is None:
            return None
        try:
            heartbeat = Heartbeat.model_validate_json(body)
            path = scope.get("raw_path", PATH.encode()).decode("latin-1")
            nonce = verify_request(
                public_key,
                "POST",
                path,
                body,
                headers,
                now=self.ctx.now(),
                max_skew_s=self.ctx.settings.signature_max_skew_s,
            )
        except (ValidationError, Unauthorized):
            return None
        if self.limits.callers.take(f"node:{node_id}") > 0:
            return None  # out of calls: the route refuses it with 429, not charging it twice
        return registry.Beat(node_id, nonce, tuple(heartbeat.leases))

    async def _write(self, beat: registry.Beat) -> HeartbeatAck | None:
        try:
            return await asyncio.wrap_future(self.writer.submit(beat))
        except Exception:  # refused or not written: nothing of it stands, and the route says why
            return None


def _is_heartbeat(scope: Scope) -> bool:
    return (
        scope["type"] == "http"
        and scope["path"] == PATH
        and scope["method"] == "POST"
        and not scope.get("query_string")
    )


async def _read_body(receive: Receive, limit: int) -> tuple[list[Message], bytes | None]:
    """The messages read and the whole body, or None as the body once it passes ``limit``."""
    received: list[Message] = []
    size = 0
    while True:
        message = await receive()
        received.append(message)
        if message["type"] != "http.request":
            return received, None  # the client went away: the app sees the disconnect
        size += len(message.get("body", b""))
        if size > limit:
            return received, None
        if not message.get("more_body", False):
            return received, b"".join(m.get("body", b"") for m in received)


def _replay(received: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out the messages already read, then reads on."""
    pending = list(received)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
