"""The liveness rules the reaper applies, and ``noticed_at``: the simulator's shortcut to the pass that
first ends a dead node's lease, without simulating its heartbeats one by one."""

from hypothesis import given
from hypothesis import strategies as st

from gpuflex.market.liveness import (
    Liveness,
    lease_expired,
    lease_expires_at,
    next_pass_after,
    noticed_at,
)


def test_a_node_is_lost_only_once_its_misses_are_over():
    rules = Liveness(interval_s=2, misses=3)
    assert rules.lost_after_s == 6 and rules.suspect_after_s == 4 and rules.start_grace_s == 8
    assert not rules.is_lost(last_heartbeat_at=100, now=106)
    assert rules.is_lost(last_heartbeat_at=100, now=106.001)
    assert lease_expires_at(100, 15) == 115 and not lease_expired(115, 115) and lease_expired(115, 115.1)


def test_next_pass_is_strictly_after():
    assert next_pass_after(10.0, 1.0) == 11.0
    assert next_pass_after(10.5, 1.0) == 11.0
    assert next_pass_after(10.5, 1.0, phase_s=0.25) == 11.25


def test_a_lease_never_lapses_before_its_node_may_be_judged_lost():
    assert Liveness(2, 3).lease_ttl_s(15) == 15  # the base rules: the lease's own ttl
    assert Liveness(30, 3).lease_ttl_s(15) == 90  # a stretched fleet: a live node renews every 30 s


quarters = st.integers(1, 4 * 600).map(lambda n: n / 4)  # exact in binary: the test's sums stay exact


@given(
    registered=st.integers(0, 400_000).map(lambda n: n / 4),
    lived=st.integers(0, 40_000).map(lambda n: n / 4),
    interval=quarters,
    misses=st.integers(1, 10),
    ttl=quarters,
    reaper=quarters,
)
def test_noticed_at_is_the_first_reaper_pass_that_judges_the_dead_node(
    registered, lived, interval, misses, ttl, reaper
):
    rules = Liveness(interval, misses)
    died = registered + lived
    seen = noticed_at(died, registered, rules, lease_ttl_s=ttl, reaper_interval_s=reaper)
    last_beat = registered + (lived // interval) * interval
    expires = lease_expires_at(last_beat, rules.lease_ttl_s(ttl))  # never before the node may be lost
    judged = rules.is_lost(last_beat, seen) or lease_expired(expires, seen)
    assert seen >= died and judged
    earlier = seen - reaper  # the pass before it found the node neither lost nor expired
    if earlier > died:
        assert not rules.is_lost(last_beat, earlier)
        assert not lease_expired(expires, earlier)
