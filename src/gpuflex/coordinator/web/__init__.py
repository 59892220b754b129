"""The dashboard: server-rendered pages (Jinja2, autoescaped) with a little vanilla JavaScript.

- ``pages``     the page routes: overview, providers, jobs, a job (and its live JSON), ledger, provider
- ``signin``    sign-in with an API token (cookie), providers' signed links, sign-out
- ``viewer``    who is looking (cookies -> account and/or node), safe redirects, cookie flags
- ``tokens``    providers' short-lived, HMAC-signed dashboard tokens
- ``network``   overview and providers views; ``jobview`` a job's page; ``money`` ledger and earnings
- ``traffic``   bytes a job exchanged vs DDP; ``blobinfo`` blob sizes, remembered; ``stats`` pure maths
- ``render``    templates, filters, security headers, error pages; ``templates/``, ``static/``

``install(app)`` mounts it all on the coordinator app under ``/dashboard``.
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.web import pages, signin
from gpuflex.coordinator.web.blobinfo import BlobInfo
from gpuflex.coordinator.web.render import STATIC, error_page, is_page
from gpuflex.coordinator.web.viewer import PREFIX, SignInRequired

__all__ = ["error_page", "install", "is_page"]

PROVIDER_SIGNIN_HELP = (
    "providers sign in with a link from their node: run `gpuflex provider dashboard --data-dir DIR`"
)


async def _sign_in_required(request: Request, exc: SignInRequired) -> Response:
    if not is_page(request):
        return JSONResponse({"detail": "sign in to the dashboard first"}, status_code=401)
    if exc.provider:
        return await error_page(request, 401, PROVIDER_SIGNIN_HELP)
    return RedirectResponse(f"{PREFIX}/signin?next={quote(exc.next_path)}", status_code=303)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if is_page(request):
        return await error_page(request, exc.status_code, str(exc.detail))
    return await http_exception_handler(request, exc)


def install(app: FastAPI, ctx: CoordinatorContext) -> None:
    app.state.blob_info = BlobInfo(ctx.blobs)
    app.include_router(pages.root)
    app.include_router(pages.router)
    app.include_router(signin.router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC), name="dashboard-static")
    app.add_exception_handler(SignInRequired, _sign_in_required)
    app.add_exception_handler(StarletteHTTPException, _http_error)
