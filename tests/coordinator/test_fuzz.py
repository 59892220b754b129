"""Schemathesis fuzzes every operation of the OpenAPI schema against a real coordinator on loopback
(SQLite; ``GPUFLEX_FUZZ_POSTGRES=1`` adds PostgreSQL), as each kind of caller: nobody, a consumer,
the operator, a signed node and a task. No answer may be a server error, carry a status the schema
does not document, or break the documented body.

The run is derandomized (the same cases every time, so CI is reproducible) and small enough for CI;
``GPUFLEX_FUZZ_EXAMPLES=500 pytest tests/coordinator/test_fuzz.py`` searches longer.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import load_all_checks, not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpuflex.auth.signing import NodeKey
from gpuflex.protocol.spec import JobSpec

from .conftest import running_coordinator

EXAMPLES = int(os.environ.get("GPUFLEX_FUZZ_EXAMPLES", "12"))
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]
CALLERS = ("anonymous", "consumer", "operator", "node", "task")
BACKENDS = ["sqlite", "postgresql"] if os.environ.get("GPUFLEX_FUZZ_POSTGRES") else ["sqlite"]


class NodeSignature(requests.auth.AuthBase):
    """Signs each request as it goes out, over the bytes actually sent, as ``NodeClient`` does."""

    def __init__(self, key: NodeKey):
        self.key = key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        body = body.encode() if isinstance(body, str) else body
        request.headers.update(self.key.sign_request(request.method, request.path_url, body))
        return request


def _sessions(harness) -> dict[str, requests.Session]:
    """One session per kind of caller, each with real credentials on a network that has a job."""
    alice = harness.consumer("alice", deposit=100)
    alice.submit(JobSpec(name="fuzzed", resources={"workers": 1}), alice.upload(b"some text " * 100))
    core = harness.node("core", core=True)
    harness.node("worker")  # the job starts only with its aggregator and its worker placed
    grant = core.lease()
    assert grant is not None, "the job's aggregator should be leased to the core node"
    node = harness.node("fuzzer")
    tokens = {
        "consumer": alice.http._http.headers["Authorization"],
        "operator": f"Bearer {harness.ctx.settings.resolved_operator_token()}",
        "task": f"Bearer {grant.task_token}",
    }
    sessions = {who: requests.Session() for who in CALLERS}
    for who, header in tokens.items():
        sessions[who].headers["Authorization"] = header
    sessions["node"].auth = NodeSignature(node.key)
    return sessions


@pytest.fixture(scope="module", params=BACKENDS)
def network(request, tmp_path_factory):
    database_url = (
        f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'gpuflex.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_database")
    )
    data_dir = tmp_path_factory.mktemp("fuzz-data")
    # Every unauthenticated case fails authentication: let the address's bucket hold them all, so the
    # fuzzer reaches the routes rather than the rate limit (tests/coordinator/test_rate_limits.py).
    with running_coordinator(
        database_url, data_dir, lease_ttl_s=3600, anonymous_rate_limit_burst=1_000_000
    ) as harness:
        yield harness, _sessions(harness)


@pytest.fixture(scope="module")
def operations(network) -> list[APIOperation]:
    load_all_checks()
    schema = schemathesis.openapi.from_url(f"{network[0].url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation: APIOperation, send: Callable[[Case], object]) -> str | None:
    """Valid and invalid cases of one operation; the first failure, shrunk, as text."""
    cases = st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode))

    @given(cases)
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    def fuzz(case: Case) -> None:
        send(case)

    try:
        fuzz()
    except (Exception, FailureGroup) as failure:  # schemathesis groups its failures in a BaseExceptionGroup
        return f"{operation.label}: {failure}"
    return None


@pytest.mark.parametrize("who", CALLERS)
def test_no_server_errors_and_every_answer_as_documented(who, network, operations):
    harness, sessions = network

    def send(case: Case) -> None:
        case.call_and_validate(base_url=harness.url, session=sessions[who], checks=CHECKS)

    failures = [failure for operation in operations if (failure := _fuzz(operation, send))]
    assert not failures, f"{len(failures)} of {len(operations)} operations failed:\n\n" + "\n\n".join(
        failures
    )
