"""Nodes: registration, signed-request authentication, heartbeats and liveness.

A node's id is derived from its Ed25519 public key, so registering again with the same key
updates the node in place (new price, new benchmark) instead of making a twin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Row, bindparam, delete, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuflex.auth.signing import HEADER_NODE, check_sealing_key, node_id_for, signed_request
from gpuflex.coordinator.db import Node, Nonce
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import Forbidden, Unauthorized
from gpuflex.market.liveness import Liveness
from gpuflex.protocol.messages import LeaseHeld, NodeRegister
from gpuflex.protocol.money import to_micro


def check_signature(
    session: Session,
    public_key: str,
    node_id: str,
    request: tuple[str, str, str, Mapping[str, str]],
    settings: CoordinatorSettings,
    now: float,
) -> None:
    """Verify a signed request and burn its nonce; a replayed nonce is refused."""
    method, path, body_sha256, headers = request
    nonce = signed_request(
        public_key, method, path, body_sha256, headers, now=now, max_skew_s=settings.signature_max_skew_s
    ).verify()
    try:
        with session.begin_nested():
            session.add(Nonce(node_id=node_id, nonce=nonce, seen_at=now))
    except IntegrityError:
        raise _replayed() from None


def _replayed() -> Unauthorized:
    return Unauthorized("replayed request (nonce already used)")


def _refusal(state: str | None) -> Unauthorized | None:
    """Why a node in ``state`` (None: unknown) may not act, or None if it may."""
    if state is None:
        return Unauthorized("unknown node: register first")
    if state == "left":
        return Unauthorized("this node has left; register again to rejoin")
    return None


def authenticate(
    session: Session,
    request: tuple[str, str, str, Mapping[str, str]],
    settings: CoordinatorSettings,
    now: float,
) -> Node:
    headers = request[3]
    node = session.get(Node, headers.get(HEADER_NODE, ""))
    if (why := _refusal(node and node.state)) is not None:
        raise why
    check_signature(session, node.public_key, node.id, request, settings, now)
    return node


def register(
    session: Session, msg: NodeRegister, settings: CoordinatorSettings, now: float, interval_s: float
) -> Node:
    """Add the node, or update it in place; it is told to beat every ``interval_s``."""
    if msg.kind == "core" and msg.core_token != settings.resolved_core_token():
        raise Forbidden("registering a core node needs the operator's core token")
    node_id = node_id_for(msg.public_key)
    if msg.sealing_key is not None and msg.sealing_key_signature is not None:
        check_sealing_key(node_id, msg.public_key, msg.sealing_key, msg.sealing_key_signature)
    node = session.get(Node, node_id) or Node(
        id=node_id, public_key=msg.public_key, registered_at=now, heartbeats=0, presence_s=0.0
    )
    node.name = msg.name
    node.kind = msg.kind
    node.hardware = msg.hardware.model_dump()
    node.benchmark = msg.benchmark.model_dump()
    node.tflops = msg.benchmark.tflops_bf16 or msg.benchmark.tflops_fp32
    node.vram_gb = max((g.vram_gb for g in msg.hardware.gpus), default=0.0)
    node.price_micro = to_micro(msg.price_per_hour)
    node.region = msg.region
    node.available_until = None if msg.available_hours is None else now + msg.available_hours * 3600
    node.private_data = [d.model_dump() for d in msg.private_data]
    node.consumers = sorted(set(msg.consumers))
    node.sealing_key, node.sealing_key_signature = msg.sealing_key, msg.sealing_key_signature
    if node.online_since is None:  # new, or back after leaving; a restart without leaving stays present
        node.online_since = now
    node.state = "online"
    node.last_heartbeat_at = now
    node.heartbeat_interval_s = interval_s
    session.add(node)
    session.flush()
    return node


@dataclass(frozen=True)
class Call:
    """A node's call whose signature was checked: who sent it and its nonce (burnt once admitted)."""

    node_id: str
    nonce: str


@dataclass(frozen=True)
class Beat(Call):
    """A heartbeat, with the leases its node holds."""

    held: tuple[LeaseHeld, ...]


_NODES, _NONCES = Node.__table__, Nonce.__table__
# built once: building a statement (its IN list, its cache key) cost about as much as running it
_STATES = select(Node.id, Node.state).where(Node.id.in_(bindparam("nodes", expanding=True)))
_BURN = {  # per backend: both can skip a row that exists (and not return it)
    backend.dialect.name: backend.insert(_NONCES)
    .on_conflict_do_nothing()
    .returning(_NONCES.c.node_id, _NONCES.c.nonce)
    for backend in (postgresql, sqlite)
}
_BEAT = (
    update(_NODES)
    .where(_NODES.c.id == bindparam("node"))
    .values(
        last_heartbeat_at=bindparam("now"),
        heartbeat_interval_s=bindparam("interval"),
        heartbeats=_NODES.c.heartbeats + 1,
        state="online",
    )
)


def record_beats(
    session: Session, beats: Sequence[Beat], *, interval_s: float, now: float
) -> list[Unauthorized | None]:
    """Write many heartbeats in the caller's one transaction; for each, in order, None or why it was
    refused (unknown node, a node that left, a replayed nonce). Its leases are ``leases.renew``'s.

    One statement per kind of row for the whole batch, in node id order, so that two replicas' batches
    lock rows in the same order and never deadlock.
    """
    states = session.execute(_STATES, {"nodes": list({b.node_id for b in beats})})
    outcome = admit(session, beats, dict(states.all()), now)
    rows = [
        {"node": b.node_id, "now": now, "interval": interval_s}
        for b, refused in zip(beats, outcome, strict=True)
        if refused is None
    ]
    if rows:
        session.connection().execute(_BEAT, sorted(rows, key=lambda r: r["node"]))
    return outcome


def nodes(session: Session, node_ids: Sequence[str], columns: Sequence) -> dict[str, Row]:
    """The known nodes among ``node_ids``, by id, in one query: rows of their id and ``columns``, not ORM
    objects, which a lease batch would build only to read."""
    query = select(Node.id, *columns).where(Node.id.in_(set(node_ids)))
    return {n.id: n for n in session.execute(query)}


def admit(
    session: Session, calls: Sequence[Call], states: Mapping[str, str], now: float
) -> list[Unauthorized | None]:
    """For each call, in order, None or why it is refused: its node is unknown (``states`` holds the
    state of every known node among them) or has left, or its nonce was seen before (a replay)."""
    outcome = [_refusal(states.get(call.node_id)) for call in calls]
    _burn_nonces(session, calls, outcome, now)
    return outcome


def _burn_nonces(session: Session, calls: Sequence[Call], outcome: list, now: float) -> None:
    """Insert every admitted call's nonce; one seen before, or twice in this batch, refuses its call (a
    replay). One statement: those the database already holds are skipped, and not returned."""
    fresh, seen = [], set()
    for i, refused in enumerate(outcome):
        key = (calls[i].node_id, calls[i].nonce)
        if refused is None and key in seen:
            outcome[i] = _replayed()
        elif refused is None:
            fresh.append(i)
            seen.add(key)
    if not fresh:
        return
    rows = [{"node_id": calls[i].node_id, "nonce": calls[i].nonce, "seen_at": now} for i in fresh]
    burnt = set(session.connection().execute(_BURN[session.get_bind().dialect.name], rows))
    for i in fresh:
        if (calls[i].node_id, calls[i].nonce) not in burnt:
            outcome[i] = _replayed()


def public_keys(session: Session) -> dict[str, str]:
    """The public key of every node that has not left, by id: what a replica keeps from its start."""
    return dict(session.execute(select(Node.id, Node.public_key).where(Node.state != "left")).all())


def leave(node: Node, now: float) -> None:
    """The node says goodbye: from ``now`` on, heartbeats are no longer expected of it."""
    if node.online_since is not None:
        node.presence_s += max(0.0, now - node.online_since)
        node.online_since = None
    node.state = "left"


def presence_s(node: Node, now: float) -> float:
    """Seconds the node has been registered and not left: what its heartbeats are expected over."""
    current = now - node.online_since if node.online_since is not None else 0.0
    return node.presence_s + max(0.0, current)


def hours_left(node: Node, now: float) -> float | None:
    """How long the node stays on offer, in hours (0 once its availability ran out); None: open-ended."""
    return None if node.available_until is None else max(0.0, node.available_until - now) / 3600


def mark_lost(session: Session, rules: Liveness, now: float, *, limit: int) -> list[Node]:
    """Up to ``limit`` nodes, the longest silent first, that missed ``rules.misses`` heartbeats: silent
    for that many of the fleet's intervals now and of the interval each was last told, whichever is longer."""
    silent = select(Node).where(
        Node.state == "online",
        Node.last_heartbeat_at < rules.lost_deadline(now),
        or_(
            Node.heartbeat_interval_s.is_(None),
            Node.last_heartbeat_at < now - rules.misses * Node.heartbeat_interval_s,
        ),
    )
    silent = silent.order_by(Node.last_heartbeat_at, Node.id).limit(limit)
    lost = list(session.scalars(silent.with_for_update(skip_locked=True)))
    for node in lost:
        node.state = "lost"
    return lost


def prune_nonces(session: Session, settings: CoordinatorSettings, now: float) -> None:
    """A nonce older than the allowed skew can't be replayed (its timestamp is refused anyway)."""
    session.execute(delete(Nonce).where(Nonce.seen_at < now - 2 * settings.signature_max_skew_s))


def online(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).where(Node.state == "online").order_by(Node.id)))


def all_nodes(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).order_by(Node.id)))
