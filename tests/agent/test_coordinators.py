"""An agent given several coordinator processes (``--url A,B``) reaches a live one: a call that cannot
reach one goes to the next at once, and later calls stay there; none reachable is one clear error."""

from __future__ import annotations

import httpx
import pytest

from gpuflex.client.http import HttpSession
from gpuflex.errors import ServiceError


def _network(up: set[str], seen: list[str]) -> httpx.MockTransport:
    """Coordinators at the hosts in ``up`` answer; the others refuse connections."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host not in up:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"at": request.url.host})

    return httpx.MockTransport(handle)


def test_a_call_goes_to_the_next_coordinator_when_one_cannot_be_reached_and_stays_there():
    seen: list[str] = []
    session = HttpSession("http://a:8750, http://b:8750/", transport=_network({"b"}, seen))
    assert session.request("GET", "/healthz").json() == {"at": "b"}
    assert session.request("GET", "/healthz").json() == {"at": "b"}
    assert seen == ["a", "b", "b"] and session.base_url == "http://b:8750"


def test_no_coordinator_reachable_is_one_clear_error_naming_it():
    session = HttpSession("http://a:8750,http://b:8750", transport=_network(set(), []))
    with pytest.raises(ServiceError, match="cannot reach the coordinator at http://b:8750"):
        session.request("GET", "/healthz")
