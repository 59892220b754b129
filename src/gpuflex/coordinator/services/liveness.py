"""The heartbeat rules a node is held to: how often it beats, and when its silence makes it lost.

The governed ``heartbeat_interval_s`` is the base. A fleet too large for it beats less often, so the
coordinator's total heartbeat rate stays under ``heartbeat_max_rate_per_s`` however many nodes join
(Nomad's rule): interval = max(base, online nodes / max rate). Every register and heartbeat tells the
node its interval and keeps it on the node's row; a node is lost only after ``heartbeat_misses`` times
the longer of that and the fleet's interval now, so a node told to beat slowly is never judged by a
faster rule, whichever way the fleet or the governed base moved since.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuflex.coordinator.db import Node
from gpuflex.coordinator.services import governance
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.market.liveness import Liveness, fleet_interval_s


def online_nodes(session: Session) -> int:
    return session.scalar(select(func.count(Node.id)).where(Node.state == "online"))


def rules(session: Session, settings: CoordinatorSettings, now: float) -> Liveness:
    """The governed heartbeat rules, the interval stretched to the fleet online now."""
    base = governance.parameter(session, "heartbeat_interval_s", settings, now)
    return Liveness(
        interval_s=fleet_interval_s(base, online_nodes(session), settings.heartbeat_max_rate_per_s),
        misses=int(governance.parameter(session, "heartbeat_misses", settings, now)),
    )
