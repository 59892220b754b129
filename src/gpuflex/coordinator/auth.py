"""Who is calling: a consumer (API token), a node (Ed25519 signature), a task (lease-scoped token), the
operator (its own token, for verdicts), or anyone at all (the network's public record).

Each is a FastAPI dependency typed with ``Annotated`` so a route's signature says who may call it.
Authentication runs in its own short transaction (a node's nonce is burnt even if the action fails).
Once a caller has authenticated, its call is charged to its own rate limit (``ratelimit``); a call
that proves nobody is charged to the client's address.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from gpuflex.auth import signing
from gpuflex.auth.signing import HEADER_NODE, HEADER_SIGNATURE
from gpuflex.auth.tokens import API_PREFIX, DEPLOYMENT_KEY_PREFIX, TASK_PREFIX
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import Account, Job, Lease, Node
from gpuflex.coordinator.services import accounts, deployment_keys, leases, registry
from gpuflex.errors import Forbidden, Unauthorized


async def get_context(request: Request) -> CoordinatorContext:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per request
    return request.app.state.ctx


def charge(request: Request, who: str) -> None:
    """Count one call of an authenticated caller (``account:…``, ``node:…``, ``lease:…``); 429 if over."""
    request.app.state.rate_limits.charge_caller(who)


def anonymous_call(request: Request) -> None:
    """Count one call that proves nobody (a sign-up, a public read) against the client's address; 429
    if over."""
    request.app.state.rate_limits.charge_address(client_address(request))


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


Ctx = Annotated[CoordinatorContext, Depends(get_context)]


def bearer(request: Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def current_account(request: Request, ctx: Ctx) -> Account:
    token = bearer(request)
    if not token or not token.startswith(API_PREFIX):
        raise Unauthorized("this endpoint needs an API token: Authorization: Bearer gfx_...")
    with ctx.tx() as s:
        account = accounts.authenticate(s, token)
    charge(request, f"account:{account.id}")
    return account


def task_token(request: Request) -> str:
    """The caller's task token; ``Unauthorized`` without one."""
    token = bearer(request)
    if not token or not token.startswith(TASK_PREFIX):
        raise Unauthorized("this endpoint needs a task token: Authorization: Bearer gfxtask_...")
    return token


def current_task(request: Request, ctx: Ctx) -> Lease:
    token = task_token(request)
    with ctx.tx() as s:
        lease = leases.authenticate_task(s, token, ctx.now())
    charge(request, f"lease:{lease.id}")
    return lease


@dataclass(frozen=True)
class GatewayCaller:
    """Who calls the OpenAI gateway: an account (its token: any of its deployments), or an API key of
    one deployment (``key_id``: only ``deployment_id``, on its owner's behalf)."""

    account_id: str
    key_id: str | None = None
    deployment_id: str | None = None


def gateway_caller(request: Request, ctx: Ctx) -> GatewayCaller:
    token = bearer(request)
    if token and token.startswith(DEPLOYMENT_KEY_PREFIX):
        with ctx.read() as s:
            key = deployment_keys.authenticate(s, token)
            owner = s.get(Job, key.deployment_id).account_id
        charge(request, f"key:{key.id}")
        return GatewayCaller(owner, key.id, key.deployment_id)
    if token and token.startswith(API_PREFIX):
        with ctx.read() as s:
            account = accounts.authenticate(s, token)
        charge(request, f"account:{account.id}")
        return GatewayCaller(account.id)
    raise Unauthorized(
        "missing or malformed API key: send a deployment's key (`gpuflex deployment key create DEP`) or "
        "your account token as Authorization: Bearer KEY (the openai client's api_key)"
    )


def operator(request: Request, ctx: Ctx) -> None:
    """The operator alone may pass verdicts: its token is a secret of the coordinator's, never stored."""
    token = bearer(request)
    if not token:
        raise Unauthorized("this endpoint needs the operator's token: Authorization: Bearer gfxop_...")
    if not secrets.compare_digest(token, ctx.settings.resolved_operator_token()):
        raise Forbidden("only the operator may do this")


async def signed_request(request: Request) -> tuple[str, str, str, object]:
    """The parts of a request a node signs: the path as sent (still percent-encoded, as the client
    signed it), its query, the body's sha256 and the headers."""
    return _signed(request, hashlib.sha256(await request.body()).hexdigest())


def signed_upload(request: Request) -> tuple[str, str, str, object]:
    """A blob upload's signed parts, its body unread: the body must hash to the key in the path (the
    store refuses it otherwise), so the key stands for the body's hash, and the body streams in after."""
    return _signed(request, request.path_params["digest"])


def _signed(request: Request, body_sha256: str) -> tuple[str, str, str, object]:
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    path = raw_path.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
    return request.method, path, body_sha256, request.headers


SignedRequest = Annotated[tuple, Depends(signed_request)]
SignedUpload = Annotated[tuple, Depends(signed_upload)]


async def verified_signature(signed: SignedRequest, ctx: Ctx) -> tuple[str, str]:
    """The node id and nonce of a request whose signature checks out, read without a transaction: a
    node's public key never changes (its id is the key's hash), so each replica keeps the keys it has read.
    Whether the node may still act, and whether the nonce is fresh, is for the caller to check."""
    node_id = signed[3].get(HEADER_NODE, "")
    public_key = ctx.node_keys.get(node_id)
    if public_key is None:

        def read() -> str | None:
            with ctx.read() as s:
                return s.scalar(select(Node.public_key).where(Node.id == node_id))

        public_key = await run_in_threadpool(read)
        if public_key is None:
            raise Unauthorized("unknown node: register first")
        ctx.node_keys[node_id] = public_key
    method, path, body_sha256, headers = signed
    nonce = signing.signed_request(
        public_key,
        method,
        path,
        body_sha256,
        headers,
        now=ctx.now(),
        max_skew_s=ctx.settings.signature_max_skew_s,
    ).verify()
    return node_id, nonce


async def current_node(request: Request, signed: SignedRequest, ctx: Ctx) -> Node:
    def check() -> Node:
        with ctx.tx() as s:
            return registry.authenticate(s, signed, ctx.settings, ctx.now())

    node = await run_in_threadpool(check)
    charge(request, f"node:{node.id}")
    return node


async def blob_reader(request: Request, ctx: Ctx, signed: SignedRequest) -> str:
    """Blobs are read by nodes and tasks; consumers fetch their results through their jobs."""
    token = bearer(request)
    if token and token.startswith(TASK_PREFIX):
        return (await run_in_threadpool(current_task, request, ctx)).node_id
    if HEADER_SIGNATURE in request.headers:
        return (await current_node(request, signed, ctx)).id
    if token:
        raise Forbidden("consumers fetch results through their jobs (GET /v1/jobs/{id}/checkpoint)")
    raise Unauthorized("reading blobs needs a node signature or a task token")


async def blob_writer(request: Request, ctx: Ctx, signed: SignedRequest) -> str:
    """Anyone authenticated may add a blob: it is named by its hash and changes nothing else."""
    token = bearer(request)
    if token and token.startswith(API_PREFIX):
        return (await run_in_threadpool(current_account, request, ctx)).id
    return await blob_reader(request, ctx, signed)


async def blob_uploader(request: Request, ctx: Ctx, signed: SignedUpload) -> str:
    """A blob writer known before its upload's body is read (the route streams it into the store)."""
    return await blob_writer(request, ctx, signed)


async def anyone(request: Request, ctx: Ctx, signed: SignedRequest) -> None:
    """Who reads the network's public record (the journal, verdicts, governance, offers): anyone, so
    anyone can audit. A caller that shows an API token or a node signature is checked (401 if bad) and
    counted as itself; any other call is counted against the client's address, as sign-ups are."""
    token = bearer(request)
    if token and token.startswith(API_PREFIX):
        await run_in_threadpool(current_account, request, ctx)
    elif HEADER_SIGNATURE in request.headers:
        await current_node(request, signed, ctx)
    else:
        anonymous_call(request)


Consumer = Annotated[Account, Depends(current_account)]
Operator = Depends(operator)
SignedNode = Annotated[Node, Depends(current_node)]
VerifiedSignature = Annotated[tuple[str, str], Depends(verified_signature)]
TaskLease = Annotated[Lease, Depends(current_task)]
BlobReader = Annotated[str, Depends(blob_reader)]
BlobWriter = Annotated[str, Depends(blob_writer)]
BlobUploader = Annotated[str, Depends(blob_uploader)]
Anonymous = Depends(anonymous_call)
Public = Depends(anyone)
