"""Reputation: one score in [0, 1] per node, from how it kept its word.

    score = uptime x completion x audit

    uptime     = (min(beats, expected) + 9) / (expected + 10)
    completion = (good + 3) / (good + bad + 4)
    audit      = (passed + 1) / (passed + 1 + 10 x failed)

- **uptime**: heartbeats received over heartbeats expected while the node was registered and had not
  left (expected = that time / the heartbeat interval; a lost node keeps being expected). Beats
  beyond the expected count do not lift it past 1. Prior: 9 of 10 beats (Beta(9, 1)), worth about
  ten heartbeat intervals, so the first few beats can't swing it to either end.
- **completion**: of the node's ended leases, those that ended well (``completed``: ran until the job
  ended; ``released``: handed back in order) over all that ended, the bad ones being ``failed`` and
  ``expired`` (it stopped renewing: crashed, lost, restarted). Prior: 3 of 4 (Beta(3, 1)), worth four
  leases.
- **audit**: 1 until an audit fails. A failed audit is evidence of wrong work, not of bad luck, so it
  weighs as much as ten passed ones: one failure cuts a new node's factor to 1/11 and a node with 99
  passes to 100/110; only many more passes earn it back.

The product reads as the chance that a task placed on the node finds it up, runs to its end, and is
done honestly, which is what ``matching``'s cost per useful TFLOP (price / (tflops x reliability))
divides by. A brand-new node scores 0.9 x 0.75 x 1 = 0.675: moderate, neither trusted nor shunned.
Pure: the coordinator gathers the counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

GOOD_LEASE_ENDS = ("completed", "released")
BAD_LEASE_ENDS = ("failed", "expired")

UPTIME_PRIOR = (9.0, 1.0)  # pseudo-beats (received, missed)
COMPLETION_PRIOR = (3.0, 1.0)  # pseudo-leases (ended well, ended badly)
AUDIT_FAILURE_WEIGHT = 10.0  # a failed audit counts as this many passed ones, against the node


@dataclass(frozen=True)
class Record:
    """What a node did, as the coordinator counted it."""

    heartbeats: int = 0
    expected_heartbeats: float = 0.0
    good_leases: int = 0
    bad_leases: int = 0
    audits_passed: int = 0
    audits_failed: int = 0

    @classmethod
    def of(
        cls,
        *,
        heartbeats: int,
        present_s: float,
        heartbeat_interval_s: float,
        lease_ends: Mapping[str, int],
        audits_passed: int,
        audits_failed: int,
    ) -> Record:
        """From raw counts: seconds registered and not left, and how many leases ended in each state."""
        return cls(  # by position, which is faster: the simulator builds one whenever a node becomes free
            heartbeats,
            max(present_s, 0.0) / heartbeat_interval_s,
            sum(lease_ends.get(s, 0) for s in GOOD_LEASE_ENDS),
            sum(lease_ends.get(s, 0) for s in BAD_LEASE_ENDS),
            audits_passed,
            audits_failed,
        )


@dataclass(frozen=True)
class Reputation:
    uptime: float
    completion: float
    audit: float

    @property
    def score(self) -> float:
        return self.uptime * self.completion * self.audit


def reputation(r: Record) -> Reputation:
    """The three factors of ``r``'s score (module docstring)."""
    return Reputation(*_factors(r))


def score(r: Record) -> float:
    """The node's reliability in [0, 1]: ``reputation(r).score``, without building the ``Reputation``."""
    uptime, completion, audit = _factors(r)
    return uptime * completion * audit


def _factors(r: Record) -> tuple[float, float, float]:
    """Uptime, completion and audit."""
    up, down = UPTIME_PRIOR
    expected = max(r.expected_heartbeats, 0.0)
    uptime = (min(r.heartbeats, expected) + up) / (expected + up + down)
    good, bad = COMPLETION_PRIOR
    completion = (r.good_leases + good) / (r.good_leases + r.bad_leases + good + bad)
    audit = (r.audits_passed + 1) / (r.audits_passed + 1 + AUDIT_FAILURE_WEIGHT * r.audits_failed)
    return uptime, completion, audit
