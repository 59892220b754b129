"""The fast path of the calls every node makes often: an ASGI layer that answers a good heartbeat or
lease request without the framework.

They are most of the coordinator's traffic. Profiled under load (py-spy), a heartbeat spent about two
thirds of the event loop's time in FastAPI's routing, middleware and dependency solving, and a third in
the one thing it must do: check the Ed25519 signature. This layer does only what a good call needs — a
body within the limit (a heartbeat's valid, a lease request's empty), a node whose key this replica has
read, fresh signature headers — and queues it on the same group commit the route uses. The group
commit's checker threads verify the signature and take the node's rate-limit token before the call is
written: a verification is about a fifth of a heartbeat's cost (perf), and it releases the GIL, so it
runs beside the event loop instead of on it.

Anything else is handed to the app unchanged (its body replayed), so the routes in ``routes.nodes`` stay
the one definition of every refusal: a bad body (422), an unknown node or a bad signature (401), a
rate-limited node (429), a replayed nonce, a database error. A call the writer refused wrote nothing,
so it too is handed over and refused by the route.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuflex.auth.signing import HEADER_NODE, SignedRequest, signed_request
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.groupcommit import GroupCommit, HeartbeatWriter, LeaseGranter
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.ratelimit import RateLimits
from gpuflex.coordinator.services import registry
from gpuflex.errors import RateLimited, Unauthorized
from gpuflex.protocol.messages import API_VERSION, Heartbeat

HEARTBEAT = f"/{API_VERSION}/nodes/heartbeat"
LEASE = f"/{API_VERSION}/nodes/lease"
_JSON = [(b"content-type", b"application/json")]
_UNANSWERED = object()


class NodeCallFastPath:
    def __init__(
        self,
        app: ASGIApp,
        *,
        ctx: CoordinatorContext,
        heartbeats: HeartbeatWriter,
        lease_granter: LeaseGranter,
        limits: RateLimits,
        metrics: CoordinatorMetrics,
    ):
        self.app = app
        self.ctx = ctx
        self.writers: dict[str, GroupCommit] = {HEARTBEAT: heartbeats, LEASE: lease_granter}
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = self.writers.get(scope["path"]) if _is_plain_post(scope) else None
        if writer is None:
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        received, body = await _read_body(receive, self.ctx.settings.max_request_bytes)
        accepted = self._accept(scope, body) if body is not None else None
        answer = await _answer(writer, *accepted) if accepted is not None else _UNANSWERED
        if answer is _UNANSWERED:  # the app answers, from the start of the body
            await self.app(scope, _replay(received, receive), send)
            return
        status, payload = (204, b"") if answer is None else (200, answer.model_dump_json().encode())
        headers = [*_JSON, (b"content-length", str(len(payload)).encode())] if payload else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        self.metrics.request_seconds.labels(scope["path"], "POST", str(status)).observe(
            time.perf_counter() - began
        )

    def _accept(self, scope: Scope, body: bytes) -> tuple[registry.Call, Callable[[], None]] | None:
        """The call to write and the check it must pass first (its signature and rate limit), or
        None if anything about it is for the app to judge."""
        headers = Headers(scope=scope)
        node_id = headers.get(HEADER_NODE, "")
        public_key = self.ctx.node_keys.get(node_id)
        if public_key is None:
            return None
        try:
            if scope["path"] == HEARTBEAT:
                if headers.get("content-type", "").split(";")[0].strip() != "application/json":
                    return None
                held = tuple(Heartbeat.model_validate_json(body).leases)
            elif body:
                return None  # a lease request has no body
            path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
            signed = signed_request(
                public_key,
                "POST",
                path,
                hashlib.sha256(body).hexdigest(),
                headers,
                now=self.ctx.now(),
                max_skew_s=self.ctx.settings.signature_max_skew_s,
            )
        except (ValidationError, Unauthorized):
            return None
        call = (
            registry.Beat(node_id, signed.nonce, held)
            if scope["path"] == HEARTBEAT
            else registry.Call(node_id, signed.nonce)
        )
        return call, lambda: self._admit(node_id, signed)

    def _admit(self, node_id: str, signed: SignedRequest) -> None:
        """Run by a checker thread: a genuine signature, then a token (charged only once it is genuine, so
        nobody can spend another node's budget by naming it)."""
        signed.verify()
        if self.limits.callers.take(f"node:{node_id}") > 0:
            raise RateLimited("out of calls")  # the route refuses it with 429, not charging it twice


async def _answer(writer: GroupCommit, call: registry.Call, check: Callable[[], None]) -> object:
    try:
        return await asyncio.wrap_future(writer.submit(call, check))
    except Exception:  # refused or not written: nothing of it stands, and the route says why
        return _UNANSWERED


def _is_plain_post(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and not scope.get("query_string")


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
