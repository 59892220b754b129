"""The coordinator's app factory: routers, dashboard, metrics, error handling (a 405 that lists a path's
methods), body and rate limits, the reaper.

uvicorn --factory gpuflex.coordinator.app:create_app      # or: gpuflex coordinator serve
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpuflex import __version__
from gpuflex.coordinator import allow, broker, gateway, web
from gpuflex.coordinator.auth import anonymous_call, gateway_caller
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import make_engine, make_sessionmaker
from gpuflex.coordinator.fastpath import NodeCallFastPath
from gpuflex.coordinator.groupcommit import HeartbeatWriter, LeaseGranter
from gpuflex.coordinator.limits import BodySizeLimit
from gpuflex.coordinator.metrics import CoordinatorMetrics, RequestMetrics
from gpuflex.coordinator.metrics import router as metrics_router
from gpuflex.coordinator.ratelimit import RateLimits
from gpuflex.coordinator.relay import Relay
from gpuflex.coordinator.routes import (
    COMMON_ERRORS,
    accounts,
    blobs,
    deployments,
    governance,
    jobs,
    ledger,
    market,
    nodes,
    operator,
    relay,
    tasks,
)
from gpuflex.coordinator.routes.openai import create_router
from gpuflex.coordinator.services import deployment_keys, leases, liveness, payouts, registry
from gpuflex.coordinator.services import governance as governance_service
from gpuflex.coordinator.services import jobs as job_service
from gpuflex.coordinator.services import market as market_service
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import GPUFlexError, RateLimited, Unauthorized
from gpuflex.protocol.messages import API_VERSION
from gpuflex.storage import BlobStore, FsspecBlobStore, LocalBlobStore

log = logging.getLogger("gpuflex.coordinator")

GATEWAY_BODIES = (f"/{API_VERSION}/completions", f"/{API_VERSION}/chat/completions")


def _expired(expired: list, metrics: CoordinatorMetrics | None) -> None:
    if metrics is not None:
        metrics.leases_expired.inc(len(expired))
    for lease in expired:
        extra = {"job_id": lease.job_id, "node_id": lease.node_id, "lease_id": lease.id}
        log.info("lease expired", extra=extra)


def _find_lost(s: Session, ctx: CoordinatorContext, now: float, metrics: CoordinatorMetrics | None) -> None:
    """Mark silent nodes lost and end their leases at once, so their tasks are re-leased now.

    At most ``lease_ends_per_pass`` nodes a pass, the longest silent first: when a partition hides
    many nodes, their work trickles back to the market instead of stampeding the nodes that remain.
    """
    rules = liveness.rules(s, ctx.settings, now)
    for node in registry.mark_lost(s, rules, now, limit=ctx.settings.lease_ends_per_pass):
        silence = max(rules.interval_s, node.heartbeat_interval_s or 0) * rules.misses
        log.info("node lost", extra={"node_id": node.id})
        why = f"lost (no heartbeat for {now - node.last_heartbeat_at:.1f}s, limit {silence:g}s)"
        _expired(leases.expire_for_node(s, node.id, now, why), metrics)


def reap_once(
    ctx: CoordinatorContext, metrics: CoordinatorMetrics | None = None, *, judge_liveness: bool = True
) -> None:
    """One pass of the periodic duties; each in its own transaction so one failure spares the rest.

    ``judge_liveness`` is False for a while after this replica starts: nodes could not reach a
    coordinator that was down, so their silence proves nothing until they have had time to beat.
    """
    liveness = (
        lambda s, now: _find_lost(s, ctx, now, metrics),
        lambda s, now: _expired(leases.expire(s, now, limit=ctx.settings.lease_ends_per_pass), metrics),
    )
    duties = (
        lambda s, now: governance_service.tally_due(s, ctx.settings, now),
        *(liveness if judge_liveness else ()),
        lambda s, now: job_service.enforce_limits(
            s, now, fee_bps=governance_service.platform_fee_bps(s, ctx.settings, now)
        ),
        lambda s, now: market_service.place_pending(s, ctx.settings, now),
        lambda s, now: payouts.release_due(s, now, audit_window_s=ctx.settings.audit_window_s),
        lambda s, now: deployment_keys.settle_due(s, now, interval_s=ctx.settings.usage_settle_interval_s),
        lambda s, now: registry.prune_nonces(s, ctx.settings, now),
    )
    for duty in duties:
        try:
            with ctx.tx() as s:
                duty(s, ctx.now())
        except Exception:
            log.exception("reaper duty failed; it runs again next pass")


def _past_start_grace(ctx: CoordinatorContext, started: float) -> bool:
    """Has every node had time to beat since this replica started, under the heartbeat rules in force?"""
    try:
        with ctx.tx() as s:
            rules = liveness.rules(s, ctx.settings, ctx.now())
    except Exception:
        log.exception("reading the heartbeat rules failed; judging nobody lost this pass")
        return False
    return ctx.now() - started >= rules.start_grace_s


async def _reaper(ctx: CoordinatorContext, metrics: CoordinatorMetrics) -> None:
    started, judging = ctx.now(), False
    while True:
        judging = judging or await run_in_threadpool(_past_start_grace, ctx, started)
        await run_in_threadpool(reap_once, ctx, metrics, judge_liveness=judging)
        await asyncio.sleep(ctx.settings.reaper_interval_s)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GPUFlexError)
    async def _gpuflex_error(request: Request, exc: GPUFlexError) -> Response:
        if isinstance(exc, Unauthorized):  # a failed authentication counts against the client's address
            try:
                anonymous_call(request)
            except RateLimited as limited:
                exc = limited
        if web.is_page(request):
            return await web.error_page(request, exc.status_code, exc.message)
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s))} if isinstance(exc, RateLimited) else None
        return JSONResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
            problems.append(f"{where}: {'unknown field' if e['type'] == 'extra_forbidden' else e['msg']}")
        if web.is_page(request):
            return await web.error_page(request, 422, "; ".join(problems))
        return JSONResponse({"detail": "; ".join(problems)}, status_code=422)

    @app.exception_handler(IntegrityError)
    async def _integrity_error(_: Request, exc: IntegrityError) -> JSONResponse:
        return JSONResponse({"detail": "conflicting write; nothing was changed"}, status_code=409)

    @app.exception_handler(OperationalError)
    async def _busy(_: Request, exc: OperationalError) -> JSONResponse:
        # Lock contention is worth a retry; any other operational error (a missing column, a lost
        # server) is a fault of ours and must not hide behind "busy".
        if not any(
            word in str(exc.orig).lower() for word in ("locked", "busy", "deadlock", "could not serialize")
        ):
            log.error("database error: %s", exc)
            return JSONResponse({"detail": "internal database error"}, status_code=500)
        log.warning("database busy: %s", exc)
        return JSONResponse({"detail": "database busy; retry"}, status_code=503, headers={"Retry-After": "1"})


def blob_store(settings: CoordinatorSettings) -> BlobStore:
    """The store ``blob_url`` names (S3 and the like, through fsspec), else the local blob directory;
    checked now, so a store that cannot be reached stops the coordinator at start, not at the first job."""
    store = (
        FsspecBlobStore(settings.blob_url, **settings.blob_storage_options)
        if settings.blob_url
        else LocalBlobStore(settings.blob_dir)
    )
    store.check()
    return store


def _public_keys(ctx: CoordinatorContext) -> dict[str, str]:
    with ctx.read() as s:
        return registry.public_keys(s)


def create_app(settings: CoordinatorSettings | None = None, ctx: CoordinatorContext | None = None) -> FastAPI:
    """Build the app. Migrations are not run here: ``serve`` and the tests run them first."""
    if ctx is None:
        settings = settings or CoordinatorSettings()
        engine = make_engine(settings.sqlalchemy_url)
        ctx = CoordinatorContext(settings, engine, make_sessionmaker(engine), blob_store(settings))

    metrics = CoordinatorMetrics(ctx)
    relay_ = Relay()
    relay_.broker = broker.for_database(ctx.settings.sqlalchemy_url, relay_)
    heartbeats, lease_granter = HeartbeatWriter(ctx, metrics), LeaseGranter(ctx, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # Every known node's key up front: after a restart the fleet's calls take the fast path at once,
        # instead of each node's first one reading its key through the route.
        ctx.node_keys.update(await run_in_threadpool(_public_keys, ctx))
        heartbeats.start()
        lease_granter.start()
        if relay_.broker is not None:
            await run_in_threadpool(relay_.broker.start)
        task = asyncio.create_task(_reaper(ctx, metrics))
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await run_in_threadpool(heartbeats.stop)
        await run_in_threadpool(lease_granter.stop)
        if relay_.broker is not None:
            await run_in_threadpool(relay_.broker.stop)
        ctx.engine.dispose()

    app = FastAPI(title="GPUFlex coordinator", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.heartbeats = heartbeats
    app.state.lease_granter = lease_granter
    app.state.relay = relay_
    app.state.rate_limits = RateLimits(
        rate_per_s=ctx.settings.rate_limit_per_s,
        burst=ctx.settings.rate_limit_burst,
        anonymous_rate_per_s=ctx.settings.anonymous_rate_limit_per_s,
        anonymous_burst=ctx.settings.anonymous_rate_limit_burst,
        clock=ctx.now,
    )
    api = APIRouter(prefix=f"/{API_VERSION}", responses=COMMON_ERRORS)
    routers = (accounts, jobs, deployments, nodes, tasks, relay, blobs, market, ledger, governance, operator)
    for module in routers:
        api.include_router(module.router)
    api.include_router(create_router(gateway.backend, gateway_caller))  # the OpenAI API
    app.include_router(api)
    app.include_router(metrics_router)
    web.install(app, ctx)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    allow.install(app)
    _error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        default_limit=ctx.settings.max_request_bytes,
        limits={  # the first prefix that matches wins
            f"/{API_VERSION}/blobs/missing": ctx.settings.max_request_bytes,
            f"/{API_VERSION}/blobs/uploads": ctx.settings.max_request_bytes,
            f"/{API_VERSION}/blobs/": ctx.settings.max_blob_bytes,
            # a replica's events: a batch of completions, each with its prompt's and output's token ids
            f"/{API_VERSION}/task/relay/events": ctx.settings.max_blob_bytes,
            # the OpenAI routes read their own bodies, after the key is checked, up to their own limit, and
            # refuse a larger one as OpenAI's error object
            **dict.fromkeys(GATEWAY_BODIES, sys.maxsize),
        },
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.add_middleware(
        NodeCallFastPath,
        ctx=ctx,
        heartbeats=heartbeats,
        lease_granter=lease_granter,
        limits=app.state.rate_limits,
        metrics=metrics,
    )
    return app
