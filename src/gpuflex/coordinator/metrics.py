"""Prometheus metrics of one coordinator app, scraped at ``GET /metrics``.

Each app has its own registry (tests build several apps in one process). What is counted where:

- counters the routes bump as things happen: rounds published, leases granted, leases expired (by
  the reaper), heartbeats, blob bytes in and out through the coordinator, and blob bytes signed for
  (moved by presigned URLs straight to or from an object store);
- ``RequestMetrics``, an ASGI middleware timing every request by route template, method and status;
- per deployment, what the OpenAI gateway served (requests, input and output tokens, the seconds from
  submitting a request to its last token) and refused (by OpenAI error type and status), bumped by
  ``gateway.GatewayBackend``;
- ``DatabaseCollector``, which reads jobs by state and nodes by kind and state from the database at
  scrape time, so every replica reports the same, true numbers.

Counters are per process: behind a load balancer, sum them over the replicas.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Annotated, get_args

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import Job, Node
from gpuflex.protocol.messages import JobState

JOB_STATES: tuple[str, ...] = get_args(JobState)
# a generation takes from tens of milliseconds (a few tokens) to minutes (a long answer on a CPU)
DEPLOYMENT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
log = logging.getLogger("gpuflex.coordinator")


class DatabaseCollector(Collector):
    """Gauges read from the database when Prometheus scrapes."""

    def __init__(self, ctx: CoordinatorContext):
        self.ctx = ctx

    def collect(self):
        up = GaugeMetricFamily("gpuflex_database_up", "1 if the last scrape could read the database")
        try:
            families = self._read()
        except SQLAlchemyError as err:  # a scrape must not fail: report the database as down instead
            log.warning("metrics: cannot read the database: %s", err)
            families = []
        up.add_metric([], 1 if families else 0)
        yield up
        yield from families

    def _read(self) -> list[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("gpuflex_jobs", "Jobs by state", labels=["state"])
        nodes = GaugeMetricFamily("gpuflex_nodes", "Nodes by kind and state", labels=["kind", "state"])
        with self.ctx.tx() as s:
            by_state = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            by_node = s.execute(select(Node.kind, Node.state, func.count()).group_by(Node.kind, Node.state))
            for kind, state, count in by_node:
                nodes.add_metric([kind, state], count)
        for state in JOB_STATES:
            jobs.add_metric([state], by_state.get(state, 0))
        return [jobs, nodes]


class CoordinatorMetrics:
    """The metrics of one app. Routes bump the counters; the middleware fills ``request_seconds``."""

    def __init__(self, ctx: CoordinatorContext):
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds_published = Counter("gpuflex_rounds_published", "Rounds published", registry=r)
        self.leases_granted = Counter("gpuflex_leases_granted", "Leases granted", registry=r)
        self.leases_expired = Counter("gpuflex_leases_expired", "Leases that expired unrenewed", registry=r)
        self.verdicts = Counter(
            "gpuflex_verdicts", "Verdicts recorded, by check and outcome", ["check", "guilty"], registry=r
        )
        self.heartbeats = Counter("gpuflex_heartbeats", "Node heartbeats received", registry=r)
        self.bytes_in = Counter("gpuflex_blob_bytes_in", "Blob bytes uploaded", registry=r)
        self.bytes_out = Counter("gpuflex_blob_bytes_out", "Blob and checkpoint bytes downloaded", registry=r)
        self.bytes_signed = Counter(
            "gpuflex_blob_bytes_signed",
            "Blob bytes moved by presigned URLs to (in) or from (out) the object store, not through here",
            ["direction"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "gpuflex_http_request_duration_seconds",
            "HTTP request latency by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.deployment_requests = Counter(
            "gpuflex_deployment_requests",
            "Requests a deployment served to the end",
            ["deployment"],
            registry=r,
        )
        self.deployment_tokens = Counter(
            "gpuflex_deployment_tokens",
            "Tokens a deployment served, input or output",
            ["deployment", "kind"],
            registry=r,
        )
        self.deployment_request_seconds = Histogram(
            "gpuflex_deployment_request_duration_seconds",
            "A served request's seconds from reaching the gateway to its last token, by deployment",
            ["deployment"],
            buckets=DEPLOYMENT_BUCKETS_S,
            registry=r,
        )
        self.deployment_errors = Counter(
            "gpuflex_deployment_errors",
            "Gateway requests refused or failed, by deployment, OpenAI error type and HTTP status",
            ["deployment", "type", "status"],
            registry=r,
        )
        r.register(DatabaseCollector(ctx))

    def deployment_served(
        self, deployment_id: str, prompt_tokens: int, completion_tokens: int, seconds: float
    ) -> None:
        self.deployment_requests.labels(deployment_id).inc()
        self.deployment_tokens.labels(deployment_id, "input").inc(prompt_tokens)
        self.deployment_tokens.labels(deployment_id, "output").inc(completion_tokens)
        self.deployment_request_seconds.labels(deployment_id).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def get_metrics(request: Request) -> CoordinatorMetrics:
    return request.app.state.metrics


Metrics = Annotated[CoordinatorMetrics, Depends(get_metrics)]

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def scrape(metrics: Metrics) -> Response:
    """Prometheus metrics in the text exposition format."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def route_template(scope: Scope) -> str:
    """The matched route's template, rebuilt from the path and its parameters; "unmatched" for a 404.

    Raw paths would give every job id its own time series; templates keep the label set small.
    """
    if "endpoint" not in scope:
        return "unmatched"
    if not inspect.isroutine(scope["endpoint"]):  # a mounted app (static files): its prefix
        return f"{scope.get('root_path', '')}/{{path}}"
    path = scope["path"]
    for name, value in scope.get("path_params", {}).items():
        value = str(value)
        if value and path.endswith(f"/{value}"):
            path = f"{path[: -len(value)]}{{{name}}}"
        elif value:
            path = path.replace(f"/{value}/", f"/{{{name}}}/", 1)
    return path


class RequestMetrics:
    """Time each HTTP request; label it by route template ("/v1/jobs/{job_id}"), never by raw path."""

    def __init__(self, app: ASGIApp, metrics: CoordinatorMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500  # what the client sees if the app raises before answering

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.request_seconds.labels(route_template(scope), scope["method"], str(status)).observe(
                time.perf_counter() - began
            )
