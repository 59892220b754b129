"""Schemathesis fuzzes every operation of the OpenAPI schema against a real coordinator on loopback
(SQLite; ``GPUFLEX_FUZZ_POSTGRES=1`` adds PostgreSQL), as each kind of caller: nobody, a consumer,
the operator, a signed node and a task, with every check schemathesis has. Its examples, coverage and
fuzzing phases run, as its CLI runs them: the coverage phase sends each operation the methods its path
lacks (a 405 that names every method the path has), and boundary values of each field. No answer may be
a server error, carry a status or a header the schema does not document, or break the documented body;
a request the schema accepts may be refused only with a refusal the operation documents as a rule the
schema cannot state (``routes.unstated``).

The run is derandomized (the same cases every time, so CI is reproducible) and small enough for CI;
``GPUFLEX_FUZZ_EXAMPLES=500 pytest tests/coordinator/test_fuzz.py`` searches longer, and
``GPUFLEX_FUZZ_SEED=N`` draws other cases.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import APIOperation, Case
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.hypothesis.builder import HypothesisTestConfig, HypothesisTestMode, create_test
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gpuflex.auth.signing import NodeKey
from gpuflex.coordinator.routes import UNSTATED_RULE
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol.messages import INT64_MAX
from gpuflex.protocol.spec import JobSpec

from .conftest import running_coordinator

EXAMPLES = int(os.environ.get("GPUFLEX_FUZZ_EXAMPLES", "12"))
SEED = os.environ.get("GPUFLEX_FUZZ_SEED")
CALLERS = ("anonymous", "consumer", "operator", "node", "task")
BACKENDS = ["sqlite", "postgresql"] if os.environ.get("GPUFLEX_FUZZ_POSTGRES") else ["sqlite"]
SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    derandomize=SEED is None,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)


def _unstated_rules(operation: APIOperation) -> set[int]:
    """The statuses ``operation`` documents as refusing requests its schema accepts."""
    responses = operation.definition.raw.get("responses", {})
    return {int(status) for status, response in responses.items() if response.get(UNSTATED_RULE)}


def _over_int64(value: object) -> bool:
    if isinstance(value, dict):
        return any(_over_int64(v) for v in value.values())
    if isinstance(value, list):
        return any(_over_int64(v) for v in value)
    return isinstance(value, int) and value > INT64_MAX


def positive_data_acceptance_but_unstated_rules(ctx, response, case: Case) -> bool | None:
    """``positive_data_acceptance``, but for a refusal the operation documents as a rule its schema cannot
    state (a blob's hash is not its key; one field at most another). And not for an integer over 2^63 - 1,
    which no field takes: schemathesis's coverage phase draws 2^63 - 1's neighbours through a float
    (9223372036854776000), beyond the maximum the schema states."""
    if response.status_code in _unstated_rules(case.operation) or _over_int64([case.body, case.query]):
        return None
    return positive_data_acceptance(ctx, response, case)


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
    # Every unauthenticated case fails authentication: let the address's bucket hold them all, and each
    # caller's, so the fuzzer reaches the routes rather than the rate limit (test_rate_limits.py). The
    # request limit is the default one, which the schema's longest lists fit (4,096 blob keys).
    with running_coordinator(
        database_url,
        data_dir,
        lease_ttl_s=3600,
        anonymous_rate_limit_burst=1_000_000,
        rate_limit_burst=1_000_000,
        max_request_bytes=CoordinatorSettings.model_fields["max_request_bytes"].default,
    ) as harness:
        yield harness, _sessions(harness)


@pytest.fixture(scope="module")
def operations(network) -> list[APIOperation]:
    schema = schemathesis.openapi.from_url(f"{network[0].url}/openapi.json")
    # A body over the size limit is refused before it is read: with 413, which every /v1 operation documents
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return [result.ok() for result in schema.get_all_operations()]


@pytest.fixture(scope="module")
def checks() -> list:
    """Every check schemathesis has, ``positive_data_acceptance`` as the schema documents it."""
    load_all_checks()
    return [
        positive_data_acceptance_but_unstated_rules if check is positive_data_acceptance else check
        for check in CHECKS.get_all()
    ]


def _fuzz(operation: APIOperation, send: Callable[[Case], object]) -> str | None:
    """The cases of schemathesis's examples, coverage and fuzzing phases for one operation; the first
    failure, shrunk, as text."""
    config = HypothesisTestConfig(
        project=operation.schema.config,
        modes=list(HypothesisTestMode),
        settings=SETTINGS,
        seed=None if SEED is None else int(SEED),
    )
    fuzz = create_test(operation=operation, test_func=send, config=config)
    try:
        fuzz()
    except (Exception, FailureGroup) as failure:  # schemathesis groups its failures in a BaseExceptionGroup
        return f"{operation.label}: {failure}"
    return None


@pytest.mark.parametrize("who", CALLERS)
def test_no_server_errors_and_every_answer_as_documented(who, network, operations, checks):
    harness, sessions = network

    def send(case: Case) -> None:
        case.call_and_validate(base_url=harness.url, session=sessions[who], checks=checks)

    failures = [failure for operation in operations if (failure := _fuzz(operation, send))]
    assert not failures, f"{len(failures)} of {len(operations)} operations failed:\n\n" + "\n\n".join(
        failures
    )
