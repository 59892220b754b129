"""Rendering pages: the Jinja2 environment (autoescaped), its filters, security headers, error pages."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from fastapi import Request
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse

from gpuflex.coordinator.web.viewer import current_viewer
from gpuflex.protocol.money import format_credits, to_credits

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"

# Pages load only their own script and style; user content can't run (and is escaped anyway).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def credits(value: float | int | None, *, micro: bool = False) -> str:
    if value is None:
        return "–"
    amount = to_credits(value) if micro else float(value)
    return f"{amount:,.6f}"


def size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def clock(ts: float | datetime | None) -> str:
    if ts is None:
        return "–"
    at = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    return at.strftime("%H:%M:%S")


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    seconds = max(0, int(now - ts))
    if seconds < 90:
        return f"{seconds}s ago"
    if seconds < 5400:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


def percent(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


templates = Jinja2Templates(directory=str(TEMPLATES))
# budget: an amount with the precision it was given (a budget of 0.001 is not 0.00)
templates.env.filters.update(
    credits=credits, budget=format_credits, size=size, clock=clock, loss=loss, percent=percent
)
templates.env.globals.update(ago=ago)


def page(request: Request, name: str, status_code: int = 200, **context: object) -> HTMLResponse:
    """Render a template with the viewer and the time; autoescape keeps user content inert."""
    ctx = request.app.state.ctx
    response = templates.TemplateResponse(
        request,
        name,
        {"now": ctx.now(), "refresh_s": ctx.settings.dashboard_refresh_s, **context},
        status_code=status_code,
    )
    response.headers.update(HEADERS)
    return response


def is_page(request: Request) -> bool:
    """Dashboard pages answer errors as HTML; their JSON endpoints, like the API, as JSON."""
    path = request.url.path
    return path.startswith("/dashboard") and not path.endswith(".json")


async def error_page(request: Request, status_code: int, message: str) -> HTMLResponse:
    """An error as a page, with the header of whoever is signed in (if that can still be told)."""
    try:
        viewer = await run_in_threadpool(current_viewer, request, request.app.state.ctx)
    except Exception:  # the error may be the database itself: show the page anyway
        viewer = None
    titles = {401: "Not signed in", 403: "Not yours", 404: "Not found", 422: "Bad request"}
    title = titles.get(status_code, "Something went wrong")
    return page(
        request, "error.html", status_code, viewer=viewer, title=title, message=message, status=status_code
    )
