"""Heartbeat storms kept away: the interval grows with the fleet, a slow-beating node is judged by the
interval it was told, silent nodes are re-leased a few per pass, and a restarted coordinator judges
nobody until the nodes have had time to beat."""

from concurrent.futures import ThreadPoolExecutor

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import func, select

from gpuflex.coordinator.app import create_app, reap_once
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import Lease, Node, make_engine, make_sessionmaker
from gpuflex.market.liveness import fleet_interval_s
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import serve, wait_for

JSON = {"Content-Type": "application/json"}


def _settings(coordinator, **changes) -> None:
    coordinator.ctx.settings = coordinator.ctx.settings.model_copy(update=changes)


def _states(consumer) -> dict[str, str]:
    return {o.name: o.state for o in consumer.offers()}


def _spec(workers: int) -> JobSpec:
    body = {"name": "t", "resources": {"workers": workers}, "budget": 10.0, "max_price_per_hour": 1}
    return JobSpec.model_validate(body)


def _active_leases(coordinator) -> int:
    with coordinator.ctx.tx() as s:
        return s.scalar(select(func.count(Lease.id)).where(Lease.state == "active"))


@given(
    base=st.floats(0.1, 60),
    nodes=st.integers(0, 10**6),
    max_rate=st.floats(1, 10**5),
)
def test_the_fleet_never_beats_faster_than_the_cap_nor_a_node_faster_than_the_base(base, nodes, max_rate):
    interval = fleet_interval_s(base, nodes, max_rate)
    assert interval >= base
    assert nodes / interval <= max_rate * (1 + 1e-9)
    if nodes / base > max_rate:
        assert nodes / interval >= max_rate * (1 - 1e-9)  # no slower than the cap needs


def test_the_interval_handed_out_grows_with_the_fleet(coordinator):
    _settings(coordinator, heartbeat_max_rate_per_s=2.0)  # base 2 s: up to 4 nodes beat at the base
    first = coordinator.node("n0")
    assert first.heartbeat([]).heartbeat_interval_s == 2
    others = [coordinator.node(f"n{i}") for i in range(1, 10)]
    assert first.heartbeat([]).heartbeat_interval_s == 5  # 10 nodes / 2 per second
    for node in others[:6]:
        node.leave()
    assert first.heartbeat([]).heartbeat_interval_s == 2  # 4 online: back to the base


def test_a_node_told_a_long_interval_is_not_lost_when_the_fleet_shrinks(coordinator):
    _settings(coordinator, heartbeat_max_rate_per_s=1.0)
    alice = coordinator.consumer("alice")
    nodes = [coordinator.node(f"n{i}") for i in range(6)]
    assert nodes[0].heartbeat([]).heartbeat_interval_s == 6  # told: beat every 6 s
    for node in nodes[1:]:
        node.leave()  # the fleet's interval falls back to 2 s; n0 has not heard yet
    coordinator.clock.advance(10)  # past 3 x 2 s, within 3 x 6 s
    reap_once(coordinator.ctx)
    assert _states(alice)["n0"] == "online"
    coordinator.clock.advance(9)  # 19 s: past 3 x 6 s
    reap_once(coordinator.ctx)
    assert _states(alice)["n0"] == "lost"


def test_silent_nodes_are_judged_lost_a_few_per_pass(coordinator):
    _settings(coordinator, lease_ends_per_pass=2)
    alice = coordinator.consumer("alice", deposit=20)
    core = coordinator.node("core", core=True, price=0.4)
    workers = [coordinator.node(f"w{i}", price=0.1) for i in range(5)]
    alice.submit(_spec(workers=5), alice.upload(b"corpus " * 100))
    assert all(node.lease() is not None for node in (core, *workers))
    coordinator.clock.advance(7)  # a partition hides every worker: lost after 6 s
    core.heartbeat([])
    ended = []
    for _ in range(3):
        reap_once(coordinator.ctx)
        ended.append(6 - _active_leases(coordinator))
    assert ended == [2, 4, 5]
    assert sorted(_states(alice).values()) == ["lost"] * 5 + ["online"]


def test_unrenewed_leases_expire_a_few_per_pass(coordinator):
    _settings(coordinator, lease_ends_per_pass=2)
    alice = coordinator.consumer("alice", deposit=20)
    nodes = [coordinator.node("core", core=True, price=0.4)] + [coordinator.node(f"w{i}") for i in range(3)]
    alice.submit(_spec(workers=3), alice.upload(b"corpus " * 100))
    assert all(node.lease() is not None for node in nodes)
    for _ in range(4):  # the nodes beat (so none is lost) but renew nothing: every lease lapses at 15 s
        coordinator.clock.advance(4)
        for node in nodes:
            node.heartbeat([])
    expired = []
    for _ in range(2):
        reap_once(coordinator.ctx)
        expired.append(4 - _active_leases(coordinator))
    assert expired == [2, 4]


def test_a_lease_outlives_the_beats_of_a_fleet_stretched_past_the_lease_ttl(coordinator):
    """A node beats, and so renews its lease, once an interval: a 4 s lease must not lapse while a
    fleet large enough to stretch the interval to 6 s beats on time."""
    _settings(coordinator, heartbeat_max_rate_per_s=1.0, lease_ttl_s=4)  # 6 nodes: the interval is 6 s
    alice = coordinator.consumer("alice", deposit=20)
    nodes = [coordinator.node("core", core=True, price=0.4)] + [coordinator.node(f"w{i}") for i in range(5)]
    alice.submit(_spec(workers=1), alice.upload(b"corpus " * 100))
    assert nodes[0].heartbeat([]).heartbeat_interval_s == 6
    grants = [(node, grant) for node in nodes if (grant := node.lease()) is not None]
    assert len(grants) == 2
    for _ in range(3):  # 6 s since the last renewal, the reaper passes; then the next beat renews
        coordinator.clock.advance(6)
        reap_once(coordinator.ctx)
        assert _active_leases(coordinator) == 2
        for node, grant in grants:
            node.heartbeat([m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)])
    coordinator.clock.advance(19)  # silent past 3 x 6 s: lost, and its leases end
    reap_once(coordinator.ctx)
    assert _active_leases(coordinator) == 0


def test_a_restarted_coordinator_judges_nobody_until_nodes_could_beat(coordinator, tmp_path):
    """It was down for longer than a node may stay silent: their silence proves nothing yet."""
    alice = coordinator.consumer("alice", deposit=20)
    for name in ("a", "b"):
        coordinator.node(name, core=True, price=0.4)
    coordinator.clock.advance(10)  # down for 10 s: both nodes silent past the 6 s limit
    engine = make_engine(coordinator.ctx.settings.sqlalchemy_url)
    settings = coordinator.ctx.settings.model_copy(update={"reaper_interval_s": 0.05})
    ctx = CoordinatorContext(
        settings, engine, make_sessionmaker(engine), coordinator.ctx.blobs, coordinator.clock
    )
    with serve(create_app(ctx=ctx)):  # the restarted coordinator and its reaper
        job = alice.submit(_spec(workers=1), alice.upload(b"corpus " * 100))
        # placed by its reaper, which would have found nobody to place on had it judged the nodes lost
        wait_for(lambda: alice.job(job.id).state == "scheduled", 30, "the restarted reaper to place the job")
        assert set(_states(alice).values()) == {"online"}
        coordinator.clock.advance(9)  # past the lost-after time plus an interval since it started
        wait_for(lambda: set(_states(alice).values()) == {"lost"}, 30, "the silent nodes to be judged lost")


def test_heartbeats_written_together_are_each_counted_and_each_refused_alone(coordinator):
    """Heartbeats are committed in batches: many at once all count, and a replay or a node that left is
    refused without failing the heartbeats written with it."""
    alice = coordinator.consumer("alice")
    nodes = [coordinator.node(f"n{i}") for i in range(8)]
    gone = coordinator.node("gone")
    gone.leave()
    body = b'{"leases": []}'
    replayed = nodes[0].key.sign_request("POST", "/v1/nodes/heartbeat", body)
    with ThreadPoolExecutor(16) as pool:
        acks = list(pool.map(lambda n: [n.heartbeat([]) for _ in range(5)], nodes))
        posts = [
            pool.submit(
                coordinator.http.post, "/v1/nodes/heartbeat", content=body, headers={**headers, **JSON}
            )
            for headers in (replayed, replayed, gone.key.sign_request("POST", "/v1/nodes/heartbeat", body))
        ]
        codes = sorted((p.result().status_code, p.result().json().get("detail", "")) for p in posts)
    assert all(ack.heartbeat_interval_s == 2 for each in acks for ack in each)
    assert [c for c, _ in codes] == [200, 401, 401]
    assert "replayed" in codes[1][1] + codes[2][1] and "has left" in codes[1][1] + codes[2][1]
    with coordinator.ctx.tx() as s:
        counts = dict(s.execute(select(Node.name, Node.heartbeats)).all())
    assert counts == {"gone": 0, "n0": 6, **{f"n{i}": 5 for i in range(1, 8)}}
    assert set(_states(alice).values()) == {"online", "left"}
