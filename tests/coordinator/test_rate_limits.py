"""Rate limits: each token, node and task lease has its own bucket; sign-ups and failed authentication
count against the client's address; over the limit is a 429 with Retry-After and a clear message."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuflex.coordinator.ratelimit import TokenBuckets
from gpuflex.errors import RateLimited

from .conftest import running_coordinator


@pytest.fixture
def limited(database_url, tmp_path):
    with running_coordinator(
        database_url,
        tmp_path,
        rate_limit_per_s=1,
        rate_limit_burst=3,
        anonymous_rate_limit_per_s=1,
        anonymous_rate_limit_burst=4,
    ) as harness:
        yield harness


def _wallet(harness, client):
    return harness.http.get("/v1/wallet", headers=client.http._http.headers)


def test_a_token_over_its_limit_gets_429_and_others_do_not(limited):
    alice, bob = limited.consumer("alice"), limited.consumer("bob")
    assert [_wallet(limited, alice).status_code for _ in range(3)] == [200, 200, 200]

    refused = _wallet(limited, alice)

    assert refused.status_code == 429
    assert "too many requests" in refused.json()["detail"] and "retry in" in refused.json()["detail"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 2
    assert _wallet(limited, bob).status_code == 200
    limited.clock.advance(1.0)
    assert _wallet(limited, alice).status_code == 200


def test_a_node_over_its_limit_gets_429(limited):
    limited.clock.freeze()  # no token comes back while a loaded machine takes its seconds over the calls
    busy, quiet = limited.node("busy"), limited.node("quiet")  # registering is a call of each
    busy.heartbeat([])
    busy.lease()
    with pytest.raises(RateLimited, match="too many requests from node:"):
        busy.heartbeat([])
    assert quiet.heartbeat([]).revoked == []


def test_sign_ups_and_failed_authentication_count_against_the_address(limited):
    alice = limited.consumer("alice")  # sign-up 1 of 4
    bad = {"Authorization": "Bearer gfx_guessed"}
    assert [limited.http.get("/v1/wallet", headers=bad).status_code for _ in range(3)] == [401] * 3

    refused = limited.http.post("/v1/accounts", json={"name": "mallory"})

    assert refused.status_code == 429 and "unauthenticated" in refused.json()["detail"]
    assert limited.http.get("/v1/wallet", headers=bad).status_code == 429
    assert _wallet(limited, alice).status_code == 200  # a caller who proves who it is has its own bucket


@given(
    rate=st.floats(0.1, 100),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=200),
)
def test_a_bucket_never_grants_more_than_its_burst_plus_what_refilled(rate, burst, gaps):
    now = [0.0]
    buckets = TokenBuckets(rate, burst, clock=lambda: now[0])
    granted = 0
    for gap in gaps:
        now[0] += gap
        wait = buckets.take("k")
        granted += wait == 0
        assert wait == 0 or 0 < wait <= 1 / rate + 1e-9
    assert granted <= math.floor(burst + rate * now[0] + 1e-9)


def test_a_bucket_refills_to_its_burst_and_no_further():
    now = [0.0]
    buckets = TokenBuckets(2, 3, clock=lambda: now[0])
    assert [buckets.take("k") for _ in range(4)] == [0, 0, 0, 0.5]
    now[0] += 100
    assert [buckets.take("k") == 0 for _ in range(4)] == [True, True, True, False]


def test_the_openai_routes_refuse_with_the_429_their_schema_documents(limited):
    headers = limited.consumer("alice").http._http.headers
    answers = [limited.http.get("/v1/models", headers=headers) for _ in range(4)]

    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[-1].json()["error"]["type"] == "rate_limit_exceeded"  # OpenAI's error object
    documented = limited.http.get("/openapi.json").json()["paths"]["/v1/models"]["get"]["responses"]["429"]
    assert documented["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
