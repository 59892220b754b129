"""A 405 for a method a path does not take, whose ``Allow`` lists every method the path does take.

Starlette hands a request to the first route whose path matches, and a 405 names that route's methods
alone: ``OPTIONS /v1/jobs`` said ``Allow: POST`` though ``GET /v1/jobs`` is there too. And it matches a
concrete path (``/v1/blobs/missing``) as a template (``/v1/blobs/{digest}``) when only the template has
the method, so ``PUT /v1/blobs/missing`` was a 422 for a bad digest. OpenAPI matches concrete paths
before templated ones; ``MethodGuard`` does the same, ahead of every other route: a path's methods are
those of the routes with that concrete path, else those of every template that matches it.
"""

from __future__ import annotations

from collections.abc import Iterable
from re import Pattern

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, NoMatchFound, get_route_path
from starlette.types import Receive, Scope, Send


class MethodGuard(BaseRoute):
    """Matches a request for a known path with a method that path does not take, and answers it 405."""

    def __init__(self, routes: Iterable[BaseRoute]):
        self.concrete: dict[str, set[str]] = {}
        self.templated: list[tuple[Pattern[str], set[str]]] = []
        for route in iter_route_contexts(list(routes)):
            if not route.methods:  # a mount, or a guard
                continue
            if route.param_convertors:
                self.templated.append((route.path_regex, set(route.methods)))
            else:
                self.concrete.setdefault(route.path, set()).update(route.methods)

    def allowed(self, path: str) -> set[str]:
        """The methods ``path`` takes; empty for a path no route has."""
        if path in self.concrete:
            return self.concrete[path]
        return {method for regex, methods in self.templated if regex.match(path) for method in methods}

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return Match.NONE, {}
        allowed = self.allowed(get_route_path(scope))
        return (Match.FULL if allowed and scope["method"] not in allowed else Match.NONE), {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed = ", ".join(sorted(self.allowed(get_route_path(scope))))
        raise HTTPException(405, headers={"Allow": allowed})  # answered by the app's handlers

    def url_path_for(self, name: str, /, **path_params: object) -> str:
        raise NoMatchFound(name, path_params)


def install(app: FastAPI) -> None:
    """Put a ``MethodGuard`` of ``app``'s routes ahead of them; after the last route is added."""
    app.router.routes.insert(0, MethodGuard(app.routes))
