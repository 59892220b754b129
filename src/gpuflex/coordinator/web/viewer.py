"""Who is looking at a dashboard page: a consumer, a provider node, both, or nobody.

A consumer signs in with their API token, kept as is in an HttpOnly, SameSite=Strict cookie; a
provider with a session token from ``tokens`` (its node has no API token). A cookie that no longer
authenticates (a forged or expired token) counts as signed out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Response

from gpuflex.auth.tokens import API_PREFIX
from gpuflex.coordinator.auth import Ctx
from gpuflex.coordinator.db import Account, Node
from gpuflex.coordinator.services import accounts
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.coordinator.web import tokens
from gpuflex.errors import Unauthorized

CONSUMER_COOKIE = "gpuflex_token"
PROVIDER_COOKIE = "gpuflex_node"
PREFIX = "/dashboard"


class SignInRequired(Exception):
    """A page for signed-in viewers was asked for by someone signed out: send them to sign in."""

    def __init__(self, next_path: str, provider: bool = False):
        super().__init__(next_path)
        self.next_path = next_path
        self.provider = provider


@dataclass(frozen=True)
class Viewer:
    account: Account | None = None
    node: Node | None = None

    def consumer(self, request: Request) -> Account:
        """The signed-in consumer, or SignInRequired."""
        if self.account is None:
            raise SignInRequired(request.url.path)
        return self.account

    def provider(self, request: Request) -> Node:
        """The signed-in provider node, or SignInRequired."""
        if self.node is None:
            raise SignInRequired(request.url.path, provider=True)
        return self.node


def _account(ctx: Ctx, token: str | None) -> Account | None:
    if not token or not token.startswith(API_PREFIX):
        return None
    try:
        with ctx.tx() as s:
            return accounts.authenticate(s, token)
    except Unauthorized:
        return None


def _node(ctx: Ctx, token: str | None) -> Node | None:
    if not token:
        return None
    try:
        node_id = tokens.verify(ctx.settings.resolved_dashboard_secret(), token, "session", ctx.now())
    except Unauthorized:
        return None
    with ctx.tx() as s:
        return s.get(Node, node_id)


def current_viewer(request: Request, ctx: Ctx) -> Viewer:
    return Viewer(
        account=_account(ctx, request.cookies.get(CONSUMER_COOKIE)),
        node=_node(ctx, request.cookies.get(PROVIDER_COOKIE)),
    )


Looker = Annotated[Viewer, Depends(current_viewer)]


def safe_next(path: str | None, default: str = f"{PREFIX}/jobs") -> str:
    """Where to go after signing in: only a dashboard path on this site (no open redirect)."""
    if path and path.startswith(PREFIX) and not any(bad in path for bad in ("//", "\\", "..")):
        return path
    return default


def set_cookie(response: Response, name: str, value: str, settings: CoordinatorSettings) -> None:
    response.set_cookie(
        name,
        value,
        max_age=int(settings.dashboard_session_ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=settings.secure_cookies,
    )


def clear_cookies(response: Response, settings: CoordinatorSettings) -> None:
    for name in (CONSUMER_COOKIE, PROVIDER_COOKIE):
        response.delete_cookie(
            name, path="/", httponly=True, samesite="strict", secure=settings.secure_cookies
        )
