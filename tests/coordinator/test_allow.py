"""A method a path does not take is a 405 whose ``Allow`` lists every method the OpenAPI schema gives that
path; a concrete path is matched before a template (``/v1/blobs/missing`` before ``/v1/blobs/{digest}``).
"""

import re

import pytest

DIGEST = "0" * 64


def _allow(response) -> set[str]:
    return {method.strip() for method in response.headers["allow"].split(",")}


def test_a_405_lists_every_method_the_schema_gives_the_path(coordinator):
    paths = coordinator.http.get("/openapi.json").json()["paths"]
    for template, operations in paths.items():
        path = re.sub(r"\{[^}]+\}", "x", template)
        answer = coordinator.http.request("OPTIONS", path)
        assert answer.status_code == 405, template
        assert _allow(answer) == {method.upper() for method in operations}, template


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/blobs/missing", {"POST"}),  # not a digest: the concrete path wins
        ("GET", "/v1/blobs/missing", {"POST"}),
        ("DELETE", f"/v1/blobs/{DIGEST}", {"GET", "PUT"}),
        ("PATCH", "/v1/jobs", {"GET", "POST"}),
    ],
)
def test_a_method_the_path_lacks_is_refused_before_any_route_reads_the_request(
    coordinator, method, path, allowed
):
    answer = coordinator.http.request(method, path, json={"keys": []})
    assert answer.status_code == 405
    assert _allow(answer) == allowed
    assert answer.json() == {"detail": "Method Not Allowed"}


def test_the_methods_a_path_takes_and_unknown_paths_pass_the_guard(coordinator):
    assert coordinator.http.get("/v1/jobs").status_code == 401  # reached the route: no credentials
    assert coordinator.http.put(f"/v1/blobs/{DIGEST}", content=b"x").status_code == 401
    assert coordinator.http.get("/healthz").status_code == 200
    assert coordinator.http.request("OPTIONS", "/v1/no-such-thing").status_code == 404
