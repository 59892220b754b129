"""Anyone can audit: the journal, verdicts, governance and offers answer callers with no credentials,
counted against their address as sign-ups are; everything else still needs its caller's credentials."""

import re

import pytest

from gpuflex.auth.signing import node_id_for
from gpuflex.client import Client
from gpuflex.coordinator.routes import PUBLIC_READ
from gpuflex.protocol import messages as m

from .conftest import running_coordinator
from .test_governance import _proposal

PUBLIC = {
    ("get", "/v1/ledger/export"),
    ("get", "/v1/slashes"),
    ("get", "/v1/governance/proposals"),
    ("get", "/v1/governance/proposals/{proposal_id}"),
    ("get", "/v1/governance/parameters"),
    ("get", "/v1/offers"),
}
# Sign-ups: an account, and a node that signs with the very key it registers (test_bad_input.py).
SIGN_UPS = {("post", "/v1/accounts"), ("post", "/v1/nodes/register")}


@pytest.fixture
def limited(database_url, tmp_path):
    """Three anonymous calls per address, refilled too slowly to matter within a test."""
    with running_coordinator(
        database_url, tmp_path, anonymous_rate_limit_per_s=0.001, anonymous_rate_limit_burst=3
    ) as harness:
        yield harness


def _public_paths(harness) -> list[str]:
    proposer = harness.node("proposer")
    proposer.stake(harness.ctx.settings.governance_proposal_stake)
    proposal = proposer.propose(_proposal(harness))
    return [path.replace("{proposal_id}", proposal.id) for _, path in sorted(PUBLIC)]


def test_the_public_record_answers_anyone_and_says_so_in_the_schema(coordinator):
    paths = _public_paths(coordinator)
    worker = coordinator.node("w")
    operator = Client(coordinator.url, coordinator.ctx.settings.resolved_operator_token())
    verdict = m.SlashRequest(node_id=node_id_for(worker.key.public_key_hex), amount=1, evidence="faked work")
    operator.slash(verdict)
    for path in paths:
        assert coordinator.http.get(path).status_code == 200, path
    anyone = Client(coordinator.url)
    assert [s.evidence for s in anyone.slashes()] == ["faked work"]
    assert {o.name for o in anyone.offers()} == {"proposer", "w"}
    assert anyone.ledger().entries[-1].kind == "governance"
    assert "platform_fee_bps" in [p.name for p in anyone.parameters()]

    schema = coordinator.http.get("/openapi.json").json()["paths"]
    for method, path in PUBLIC:
        assert schema[path][method]["responses"]["401"]["description"] == PUBLIC_READ[401]["description"]


def test_credentials_sent_to_a_public_read_are_checked_and_counted_as_their_callers(limited):
    alice = limited.consumer("alice")  # the sign-up is the address's first anonymous call
    bad = limited.http.get("/v1/offers", headers={"Authorization": "Bearer gfx_guessed"})
    assert bad.status_code == 401  # refused, not taken for nobody; a failed authentication is the 2nd
    assert limited.http.get("/v1/slashes").status_code == 200
    refused = limited.http.get("/v1/ledger/export")
    assert refused.status_code == 429 and "unauthenticated" in refused.json()["detail"]
    # alice and a node have buckets of their own
    assert alice.slashes() == [] and alice.ledger().entries == []
    assert limited.node("n").http.request("GET", "/v1/governance/parameters").status_code == 200


def _call_without_credentials(harness, method: str, path: str) -> int:
    concrete = re.sub(r"\{(\w+)\}", lambda p: "a" * 64 if p.group(1) == "digest" else "x-nothing", path)
    body = {} if method in ("post", "put") else None
    return harness.http.request(method.upper(), concrete, json=body).status_code


def test_everything_else_still_needs_credentials(coordinator):
    schema = coordinator.http.get("/openapi.json").json()["paths"]
    private = [
        (method, path)
        for path, operations in schema.items()
        if path.startswith("/v1/")
        for method in operations
        if (method, path) not in PUBLIC | SIGN_UPS
    ]
    assert ("get", "/v1/jobs") in private and ("get", "/v1/wallet") in private
    answers = {
        (method, path): _call_without_credentials(coordinator, method, path) for method, path in private
    }
    assert {call: code for call, code in answers.items() if code != 401} == {}
