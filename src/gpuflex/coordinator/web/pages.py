"""The dashboard's pages: parse, read one view in one transaction, render.

Public: the overview and the providers list (prices, benchmarks, states; no one's earnings).
A consumer's: their jobs, a job page and its live data, their deployments, the ledger.
A provider's: its earnings.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from gpuflex.coordinator.auth import Ctx
from gpuflex.coordinator.services import jobs
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.coordinator.web import deployview, jobview, money, network
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.render import page
from gpuflex.coordinator.web.viewer import PREFIX, Looker, SignInRequired
from gpuflex.ledger import accounts

router = APIRouter(prefix=PREFIX, include_in_schema=False)
root = APIRouter(include_in_schema=False)


def _blobs(request: Request) -> BlobInfo:
    return request.app.state.blob_info


@root.get("/")
def home() -> RedirectResponse:
    return RedirectResponse(PREFIX, status_code=303)


@router.get("")
def overview(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    with ctx.tx() as s:
        stats = network.overview(s, _blobs(request))
        mine = (
            [jobs.info(s, j, ctx.now()) for j in jobs.list_for(s, viewer.account)] if viewer.account else []
        )
    return page(request, "overview.html", viewer=viewer, stats=stats, jobs=mine[::-1][:5], live=True)


@router.get("/providers")
def providers(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    with ctx.tx() as s:
        own = viewer.node.id if viewer.node else None
        interval_s = ctx.liveness(s).interval_s
        rows = network.providers(s, ctx.now(), interval_s, own=own)
    return page(request, "providers.html", viewer=viewer, providers=rows, live=True)


@router.get("/jobs")
def job_list(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    account = viewer.consumer(request)
    with ctx.tx() as s:
        rows = [jobs.info(s, j, ctx.now()) for j in jobs.list_for(s, account)]
    return page(request, "jobs.html", viewer=viewer, jobs=rows[::-1], live=True)


@router.get("/jobs/{job_id}")
def job_page(job_id: str, request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    account = viewer.consumer(request)
    with ctx.tx() as s:
        view = jobview.job_page(s, _blobs(request), jobs.owned(s, account, job_id), ctx.now())
    return page(request, "job.html", viewer=viewer, view=view, live=view.job.state in OPEN_JOB_STATES)


@router.get("/jobs/{job_id}/live.json")
def job_live(job_id: str, request: Request, viewer: Looker, ctx: Ctx) -> dict:
    """The loss curve and headline of a job, for its page's script."""
    account = viewer.consumer(request)
    with ctx.tx() as s:
        return jobview.live(s, jobs.owned(s, account, job_id), ctx.now())


@router.get("/deployments")
def deployment_list(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    account = viewer.consumer(request)
    with ctx.tx() as s:
        rows = deployview.deployments_page(s, account, request.app.state.relay, ctx.now())
    return page(request, "deployments.html", viewer=viewer, deployments=rows, live=True)


@router.get("/ledger")
def ledger_page(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    if viewer.account is None and viewer.node is None:
        raise SignInRequired(request.url.path)
    with ctx.tx() as s:
        if viewer.account is not None:
            mine = money.consumer_accounts(s, viewer.account.id)
        else:
            mine = {accounts.provider(viewer.node.id): "your earnings"}
        view = money.ledger_view(s, mine)
    return page(request, "ledger.html", viewer=viewer, view=view)


@router.get("/provider")
def provider_page(request: Request, viewer: Looker, ctx: Ctx) -> HTMLResponse:
    node = viewer.provider(request)
    with ctx.tx() as s:
        view = money.earnings(s, node, ctx.now())
    return page(request, "provider.html", viewer=viewer, view=view, live=True)
