"""The market's offers through the real API, the SDK and the CLI: the query language, sorting,
reliability (reputation) and the hours a node has left, and what placement makes of them."""

import os
import re
import subprocess
import sys

import pytest

from gpuflex.auth.signing import node_id_for
from gpuflex.client import Client
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Node
from gpuflex.coordinator.services import registry
from gpuflex.errors import BadRequest
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

NEW_NODE = 0.9 * 0.75  # a brand-new node's score: the priors of uptime and completion


def _market(coordinator):
    a100 = m.GpuInfo(name="NVIDIA A100-SXM4", vram_gb=80)
    rtx = m.GpuInfo(name="NVIDIA GeForce RTX 4090", vram_gb=24)
    coordinator.node("a100", core=True, price=1.2, tflops=150, region="us", gpu=a100)
    coordinator.node("4090", price=0.4, tflops=80, region="eu", gpu=rtx, available_hours=48)
    coordinator.node("cpu", price=0.01, tflops=0.5, region="eu")
    return coordinator.consumer("alice")


def _names(offers) -> list[str]:
    return [o.name for o in offers]


def _node_id(client) -> str:
    return node_id_for(client.key.public_key_hex)


def test_a_query_picks_offers_and_an_order_sorts_them(coordinator):
    alice = _market(coordinator)
    assert _names(alice.offers()) == ["cpu", "4090", "a100"]  # default: online first, cheapest
    assert _names(alice.offers("vram>=16 price<=0.5")) == ["4090"]
    assert _names(alice.offers("region in [eu, us] gpu=a100")) == ["a100"]
    assert _names(alice.offers("kind=community device=cpu")) == ["cpu"]
    assert _names(alice.offers("hours>=24", order="-tflops")) == ["a100", "4090", "cpu"]  # open-ended too
    assert _names(alice.offers("hours<24")) == []
    assert _names(alice.offers(order="-price")) == ["a100", "4090", "cpu"]
    assert _names(alice.offers("kind=community", order="-vram,price")) == ["4090", "cpu"]
    assert _names(alice.offers("reliability>=0.99")) == []  # nobody has earned that yet


def test_offers_carry_reliability_and_hours_left(coordinator):
    start = coordinator.clock()
    offers = {o.name: o for o in _market(coordinator).offers()}
    beats_due = (coordinator.clock() - start) / 2  # the harness's heartbeat interval: 2 s
    assert offers["4090"].hours == pytest.approx(48, abs=0.01)
    assert offers["cpu"].hours is None and offers["a100"].hours is None  # open-ended
    for offer in offers.values():  # the priors, less the heartbeats due since registering (none came)
        assert NEW_NODE * 10 / (10 + beats_due) <= offer.reliability <= NEW_NODE


def test_a_bad_query_is_a_400_whose_message_points_at_the_token(coordinator):
    alice = _market(coordinator)
    token = Client(coordinator.url).create_account("bob").token
    response = coordinator.http.get(
        "/v1/offers", params={"q": "vrm>=16 price<=0.5"}, headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 400
    assert response.json()["detail"].splitlines() == [
        "bad query at column 1: unknown field 'vrm' "
        "(known: vram, tflops, price, reliability, hours, region, kind, gpu, device, state, name)",
        "  vrm>=16 price<=0.5",
        "  ^^^",
    ]
    with pytest.raises(BadRequest) as err:
        alice.offers("price<=cheap")
    assert err.value.message.splitlines() == [
        "bad query at column 8: 'price' is a number, got 'cheap' (HTTP 400)",
        "  price<=cheap",
        "         ^^^^^",
    ]
    with pytest.raises(BadRequest, match=r"^bad order at column 7: unknown sort key 'speed'"):
        alice.offers(order="price,speed")
    with pytest.raises(BadRequest, match="at most 2000 characters"):
        alice.offers("vram>=1 " * 300)
    anyone = coordinator.http.get("/v1/offers", params={"q": "vrm>=1"})  # the market is public
    assert anyone.status_code == 400 and "unknown field 'vrm'" in anyone.json()["detail"]


def test_the_cli_prints_the_offers_and_a_bad_query_as_its_message_with_the_caret(coordinator):
    alice = _market(coordinator)
    token = Client(coordinator.url).create_account("carol").token

    def gpuflex(*args: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "gpuflex",
            "offers",
            *args,
            "--url",
            coordinator.url,
            "--token",
            token,
        ]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}
        )

    def reliability() -> dict[str, float]:
        return {o.name: o.reliability for o in alice.offers()}

    before = reliability()  # a silent node's score only falls while the CLI starts, however slowly
    listed = gpuflex("region in [eu]", "--order", "-price")
    after = reliability()
    assert listed.returncode == 0, listed.stderr
    assert "reliable" in listed.stdout and "h left" in listed.stdout
    rows = [line for line in listed.stdout.splitlines() if " 4090 " in line or " cpu " in line]
    assert len(rows) == 2 and " 4090 " in rows[0]  # dearest first
    assert "48.0" in rows[0] and "open" in rows[1]  # hours left
    for row, name in zip(rows, ("4090", "cpu"), strict=True):
        printed = int(re.search(r" (\d+)% ", row).group(1))
        assert round(100 * after[name]) <= printed <= round(100 * before[name])
    bad = gpuflex("region in [eu, us")
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [
        "error: bad query at column 11: unterminated '[' (HTTP 400)",
        "  region in [eu, us",
        "            ^^^^^^^",
    ]


def test_reliability_counts_heartbeats_and_stops_counting_once_a_node_leaves(coordinator):
    steady, _silent, leaver = (coordinator.node(n) for n in ("steady", "silent", "leaver"))
    alice = coordinator.consumer("alice")
    coordinator.clock.advance(30)  # 15 heartbeat intervals of 2 s
    for _ in range(15):
        steady.heartbeat([])
        leaver.heartbeat([])
    leaver.leave()
    before = {o.name: o.reliability for o in alice.offers()}
    with coordinator.ctx.tx() as s:  # the clock is real time plus 30 s: the test's own seconds count too
        expected = {n.name: registry.presence_s(n, coordinator.ctx.now()) / 2 for n in registry.all_nodes(s)}
    assert 15 <= expected["steady"] < 18  # heartbeats due: 15, plus the test's own time
    assert before["steady"] == pytest.approx((15 + 9) / (expected["steady"] + 10) * 0.75, abs=0.005)
    assert before["silent"] == pytest.approx(9 / (expected["silent"] + 10) * 0.75, abs=0.005)
    coordinator.clock.advance(20)
    after = {o.name: o.reliability for o in alice.offers()}
    assert after["silent"] < before["silent"] and after["steady"] < before["steady"]
    assert after["leaver"] == pytest.approx(before["leaver"])  # no heartbeat is expected of it any more


def test_a_failed_audit_sinks_a_cheap_node_below_a_dearer_honest_one(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    coordinator.node("core", core=True, price=0.3)
    cheap, honest = coordinator.node("cheap", price=0.1), coordinator.node("honest", price=0.15)
    with coordinator.ctx.tx() as s:
        s.get(Node, _node_id(cheap)).audits_failed = 1
    offers = {o.name: o.reliability for o in alice.offers()}
    # the audit term is 1/11 of the honest node's; their uptime terms differ by the real seconds between
    # the two registrations (a loaded machine made that 1.5%), hence the loose tolerance
    assert offers["cheap"] == pytest.approx(offers["honest"] / 11, rel=0.05)
    spec = JobSpec.model_validate({"name": "t", "resources": {"workers": 1}, "budget": 1.0})
    job = alice.submit(spec, alice.upload(b"corpus " * 2000))
    reap_once(coordinator.ctx)
    worker = next(t for t in alice.job(job.id).tasks if t.role == "worker")
    assert worker.node_id == _node_id(honest)
    assert worker.placement.startswith("rank 1 of 2 eligible community nodes")


def test_no_new_task_goes_to_a_node_whose_availability_ran_out(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    coordinator.node("core", core=True, price=0.3)
    brief = coordinator.node("brief", price=0.05, available_hours=10 / 3600)  # ten seconds
    spec = JobSpec.model_validate({"name": "t", "resources": {"workers": 1}, "budget": 1.0})
    job = alice.submit(spec, alice.upload(b"corpus " * 2000))
    reap_once(coordinator.ctx)

    def worker_node() -> str | None:
        return next(t.node_id for t in alice.job(job.id).tasks if t.role == "worker")

    assert worker_node() == _node_id(brief)  # placed while it was still on offer, not yet leased
    coordinator.clock.advance(15)
    assert {o.name: o.hours for o in alice.offers()}["brief"] == 0
    assert "brief" not in _names(alice.offers("hours>0"))
    reap_once(coordinator.ctx)
    assert worker_node() is None  # handed back: the node's time ran out before it leased the task
    assert brief.lease() is None
    steady = coordinator.node("steady", price=0.2)
    reap_once(coordinator.ctx)
    assert worker_node() == _node_id(steady)
