"""The fast path answers good heartbeats and lease requests itself and hands everything else to the
route, which refuses it exactly as before; nothing is written or counted twice."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import select

from gpuflex.coordinator.db import Node
from gpuflex.coordinator.fastpath import HEARTBEAT as PATH
from gpuflex.coordinator.fastpath import LEASE, NodeCallFastPath
from gpuflex.coordinator.groupcommit import HeartbeatWriter, LeaseGranter
from gpuflex.coordinator.metrics import CoordinatorMetrics
from gpuflex.coordinator.ratelimit import RateLimits
from gpuflex.protocol.messages import LeaseGrant
from gpuflex.protocol.spec import JobSpec

from .conftest import running_coordinator


def _beats(harness, node_id: str) -> int:
    with harness.ctx.sessions() as s:
        return s.scalar(select(Node.heartbeats).where(Node.id == node_id))


def _post(harness, node, body: bytes, **header_changes: str):
    headers = {
        **node.key.sign_request("POST", PATH, body),
        "Content-Type": "application/json",
        **header_changes,
    }
    return harness.http.post(PATH, content=body, headers=headers)


class _Recorder:
    """The app behind the fast path: records what reached it and answers 418."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(layer, node, body: bytes, chunks: int = 1, path: str = PATH, **header_changes: str) -> int:
    return _send(layer, node, body, chunks, path, **header_changes)[0]["status"]


def _send(layer, node, body: bytes, chunks: int = 1, path: str = PATH, **header_changes: str) -> list:
    """One call through ``layer`` as uvicorn would pass it, the body in ``chunks`` messages; what the
    layer sent back."""
    headers = {
        **node.key.sign_request("POST", path, body),
        "content-type": "application/json",
        **header_changes,
    }
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(layer(scope, receive, send))
    return sent


@pytest.fixture
def layer(coordinator):
    """The fast path around a recorder, with its own heartbeat writer on the coordinator's database."""
    ctx = coordinator.ctx
    metrics = CoordinatorMetrics(ctx)
    writer = HeartbeatWriter(ctx, metrics)
    writer.start()
    limits = RateLimits(rate_per_s=100, burst=100, anonymous_rate_per_s=1, anonymous_burst=1, clock=ctx.now)
    recorder = _Recorder()
    granter = LeaseGranter(ctx, metrics)
    granter.start()
    yield (
        NodeCallFastPath(
            recorder, ctx=ctx, heartbeats=writer, lease_granter=granter, limits=limits, metrics=metrics
        ),
        recorder,
    )
    writer.stop()
    granter.stop()


def test_a_good_heartbeat_is_answered_without_the_app_and_written_once(coordinator, layer):
    fast, app = layer
    node = coordinator.node("n1")
    del coordinator.ctx.node_keys[node.key.node_id]  # as if it had registered at another replica
    body = json.dumps({"leases": []}).encode()
    assert _call(fast, node, body) == 418  # the key is not read yet: the app's route reads it
    assert app.bodies == [body]
    coordinator.ctx.node_keys[node.key.node_id] = node.key.public_key_hex  # what the route leaves behind
    before = _beats(coordinator, node.key.node_id)

    assert _call(fast, node, body, chunks=3) == 200

    assert app.bodies == [body]  # the app never saw it
    assert _beats(coordinator, node.key.node_id) == before + 1


@pytest.mark.parametrize(
    "body, headers",
    [
        (b'{"leases": [], "extra": 1}', {}),  # a body the model refuses
        (b'{"leases": []}', {"X-GPUFlex-Signature": "00" * 64}),  # a forged signature
        (b'{"leases": []}', {"content-type": "text/plain"}),  # not JSON as declared
    ],
)
def test_anything_doubtful_reaches_the_app_with_its_body_intact(coordinator, layer, body, headers):
    fast, app = layer
    node = coordinator.node("n1")
    coordinator.ctx.node_keys[node.key.node_id] = node.key.public_key_hex
    assert _call(fast, node, body, **headers) == 418
    assert app.bodies == [body]


def test_the_route_refuses_what_the_fast_path_hands_over(coordinator):
    node = coordinator.node("n1")
    node.heartbeat([])  # through the route: this replica now knows the node's key
    body = json.dumps({"leases": []}).encode()
    signed = {**node.key.sign_request("POST", PATH, body), "Content-Type": "application/json"}
    assert coordinator.http.post(PATH, content=body, headers=signed).status_code == 200
    beats = _beats(coordinator, node.key.node_id)

    replayed = coordinator.http.post(PATH, content=body, headers=signed)
    forged = _post(coordinator, node, body, **{"X-GPUFlex-Signature": "00" * 64})
    unknown_field = _post(coordinator, node, b'{"leases": [], "extra": 1}')
    too_large = _post(coordinator, node, b'{"leases": []}' + b" " * (64 * 1024))

    assert replayed.status_code == 401 and "replayed" in replayed.json()["detail"]
    assert forged.status_code == 401 and "signature" in forged.json()["detail"]
    assert unknown_field.status_code == 422 and "extra" in unknown_field.json()["detail"]
    assert too_large.status_code == 413
    assert _beats(coordinator, node.key.node_id) == beats  # none of them was written
    node.leave()
    left = _post(coordinator, node, body)
    assert left.status_code == 401 and "left" in left.json()["detail"]


def test_a_good_lease_request_is_granted_without_the_app_and_one_with_a_body_reaches_it(coordinator, layer):
    fast, app = layer
    alice = coordinator.consumer("alice", deposit=10)
    core = coordinator.node("core", core=True, price=0.4)
    coordinator.node("c0")
    coordinator.ctx.node_keys[core.key.node_id] = core.key.public_key_hex
    spec = {"name": "t", "resources": {"workers": 1}, "budget": 1.0, "max_price_per_hour": 0.5}
    job = alice.submit(JobSpec.model_validate(spec), alice.upload(b"corpus " * 2000))

    granted = _send(fast, core, b"", path=LEASE)
    held = _call(fast, core, b"", path=LEASE)
    with_body = _call(fast, core, b"{}", path=LEASE, **{"content-type": "application/json"})

    assert granted[0]["status"] == 200
    grant = LeaseGrant.model_validate_json(granted[1]["body"])
    assert (grant.job_id, grant.role, grant.epoch) == (job.id, "aggregator", 1)
    assert held == 204  # one lease per node
    assert with_body == 418 and app.bodies == [b"{}"]  # a lease request has no body: the route judges it


def test_forged_calls_naming_a_node_do_not_spend_its_rate_limit(coordinator, layer):
    """The writer's checkers take a node's token only once its signature checks out: nobody can use up
    another node's calls by naming it."""
    fast, _ = layer
    node = coordinator.node("n1")
    coordinator.ctx.node_keys[node.key.node_id] = node.key.public_key_hex
    body = json.dumps({"leases": []}).encode()
    for _ in range(120):  # more than the layer's burst of 100
        assert _call(fast, node, body, **{"X-GPUFlex-Signature": "00" * 64}) == 418
    before = _beats(coordinator, node.key.node_id)

    assert _call(fast, node, body) == 200

    assert _beats(coordinator, node.key.node_id) == before + 1


def test_a_node_key_is_known_from_registration_so_its_first_heartbeat_takes_the_fast_path(coordinator, layer):
    fast, app = layer
    node = coordinator.node("n1")
    assert _call(fast, node, json.dumps({"leases": []}).encode()) == 200
    assert app.bodies == []


def test_a_restarted_coordinator_knows_every_node_key_before_the_first_call(
    coordinator, database_url, tmp_path
):
    """So the fleet's first calls after a restart take the fast path, not one key read each."""
    staying, leaving = coordinator.node("staying"), coordinator.node("leaving")
    leaving.leave()

    with running_coordinator(database_url, tmp_path / "restarted") as restarted:
        assert restarted.ctx.node_keys[staying.key.node_id] == staying.key.public_key_hex
        assert leaving.key.node_id not in restarted.ctx.node_keys
