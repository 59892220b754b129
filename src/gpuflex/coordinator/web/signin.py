"""Signing in and out of the dashboard: consumers post their API token; providers open a signed link."""

from __future__ import annotations

from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from gpuflex.auth.tokens import API_PREFIX
from gpuflex.coordinator.auth import Ctx
from gpuflex.coordinator.services import accounts
from gpuflex.coordinator.web import tokens
from gpuflex.coordinator.web.render import page
from gpuflex.coordinator.web.viewer import (
    CONSUMER_COOKIE,
    PREFIX,
    PROVIDER_COOKIE,
    clear_cookies,
    safe_next,
    set_cookie,
)
from gpuflex.errors import Unauthorized

router = APIRouter(prefix=PREFIX, include_in_schema=False)


async def _form(request: Request) -> dict[str, str]:
    """An HTML form's fields (application/x-www-form-urlencoded), first value of each."""
    fields = parse_qs((await request.body()).decode("utf-8", errors="replace"))
    return {k: v[0] for k, v in fields.items()}


@router.get("/signin")
def signin_form(request: Request, next_path: str | None = Query(None, alias="next")) -> HTMLResponse:
    return page(request, "signin.html", viewer=None, next=safe_next(next_path), error=None)


@router.post("/signin", response_model=None)
async def signin(request: Request, ctx: Ctx) -> HTMLResponse | RedirectResponse:
    """Check the posted API token; on success keep it in an HttpOnly cookie and go on."""
    form = await _form(request)
    token, next_path = form.get("token", "").strip(), safe_next(form.get("next"))

    def check() -> None:
        if not token.startswith(API_PREFIX):
            raise Unauthorized("an API token starts with gfx_ (gpuflex account create prints it)")
        with ctx.tx() as s:
            accounts.authenticate(s, token)

    try:
        await run_in_threadpool(check)
    except Unauthorized as err:
        return page(request, "signin.html", 401, viewer=None, next=next_path, error=err.message)
    response = RedirectResponse(next_path, status_code=303)
    set_cookie(response, CONSUMER_COOKIE, token, ctx.settings)
    return response


@router.post("/signout")
def signout(ctx: Ctx) -> RedirectResponse:
    response = RedirectResponse(PREFIX, status_code=303)
    clear_cookies(response, ctx.settings)
    return response


@router.get("/provider/signin")
def provider_signin(ctx: Ctx, token: str = Query("", max_length=2000)) -> RedirectResponse:
    """Trade a node's short-lived link for a dashboard session; a bad or expired link is a 401 page."""
    secret = ctx.settings.resolved_dashboard_secret()
    node_id = tokens.verify(secret, token, "link", ctx.now())
    session = tokens.issue(secret, node_id, "session", ctx.now() + ctx.settings.dashboard_session_ttl_s)
    response = RedirectResponse(f"{PREFIX}/provider", status_code=303)
    set_cookie(response, PROVIDER_COOKIE, session, ctx.settings)
    return response
