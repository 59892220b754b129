"""Liveness: when silence makes a node suspect or lost, when an unrenewed lease expires, and when the
coordinator's reaper first notices either.

The coordinator reads the rules in force from governance (``heartbeat_interval_s``,
``heartbeat_misses``) and applies them in its reaper and its lease grants; the simulator applies the
same rules to a node's death without simulating its heartbeats one by one: a node beats every
``interval_s`` from the moment it registers, so its last beat before it dies, and the reaper pass
that first judges it lost (or its lease expired), follow from the rules alone (``noticed_at``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    """The heartbeat rules in force: how often nodes beat, and when silence makes one suspect or lost."""

    interval_s: float
    misses: int

    @property
    def lost_after_s(self) -> float:
        return self.interval_s * self.misses

    @property
    def suspect_after_s(self) -> float:
        """A node that missed a heartbeat is suspected: rounds stop waiting for it, it is not lost yet."""
        return min(2 * self.interval_s, self.lost_after_s)

    @property
    def start_grace_s(self) -> float:
        """How long a (re)started coordinator judges nobody lost: every node has had time to beat."""
        return self.lost_after_s + self.interval_s

    def lease_ttl_s(self, base_ttl_s: float) -> float:
        """How long a lease lives past its last renewal: ``base_ttl_s``, or as long as its node is given
        before it is judged lost once the fleet has stretched the interval past that (a node beats, and so
        renews, once an interval: a shorter lease would expire between two beats of a live node)."""
        return max(base_ttl_s, self.lost_after_s)

    def lost_deadline(self, now: float) -> float:
        """A node whose last heartbeat came before this moment is lost at ``now``."""
        return now - self.lost_after_s

    def is_lost(self, last_heartbeat_at: float, now: float) -> bool:
        return last_heartbeat_at < self.lost_deadline(now)


def fleet_interval_s(base_s: float, online_nodes: int, max_rate_per_s: float) -> float:
    """The interval that keeps ``online_nodes`` beating at most ``max_rate_per_s`` times a second."""
    return max(base_s, online_nodes / max_rate_per_s)


def lease_expires_at(renewed_at: float, lease_ttl_s: float) -> float:
    """A lease granted or renewed at ``renewed_at`` lives until this moment unless renewed again."""
    return renewed_at + lease_ttl_s


def lease_expired(expires_at: float, now: float) -> bool:
    return expires_at < now


def last_beat_before(t: float, registered_at: float, interval_s: float) -> float:
    """The last heartbeat at or before ``t`` of a node that beats every ``interval_s`` since registering."""
    return registered_at + math.floor(max(t - registered_at, 0.0) / interval_s) * interval_s


def next_pass_after(t: float, reaper_interval_s: float, phase_s: float = 0.0) -> float:
    """The first reaper pass strictly after ``t`` (passes at ``phase_s + k x reaper_interval_s``)."""
    k = math.floor((t - phase_s) / reaper_interval_s) + 1
    while phase_s + k * reaper_interval_s <= t:  # the division rounded down one pass too few
        k += 1
    return phase_s + k * reaper_interval_s


def noticed_at(
    died_at: float,
    registered_at: float,
    rules: Liveness,
    *,
    lease_ttl_s: float,
    reaper_interval_s: float,
    phase_s: float = 0.0,
) -> float:
    """When the reaper first ends the leases of a node that died silently at ``died_at``: the first pass
    that finds it lost (``is_lost``) or its lease, renewed by its last beat, expired (``lease_expired``)."""
    last = last_beat_before(died_at, registered_at, rules.interval_s)
    expires_at = lease_expires_at(last, rules.lease_ttl_s(lease_ttl_s))
    lost = next_pass_after(last + rules.lost_after_s, reaper_interval_s, phase_s)
    expired = next_pass_after(expires_at, reaper_interval_s, phase_s)
    at = max(min(lost, expired), died_at)
    assert rules.is_lost(last, at) or lease_expired(expires_at, at), "rule drift"
    return at
