"""Nodes: registration, signed-request authentication, heartbeats and liveness.

A node's id is derived from its Ed25519 public key, so registering again with the same key
updates the node in place (new price, new benchmark) instead of making a twin.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpuflex.auth.signing import HEADER_NODE, node_id_for, verify_request
from gpuflex.coordinator.db import Node, Nonce
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.errors import Forbidden, Unauthorized
from gpuflex.market.liveness import Liveness
from gpuflex.protocol.messages import NodeRegister
from gpuflex.protocol.money import to_micro


def check_signature(
    session: Session,
    public_key: str,
    node_id: str,
    request: tuple[str, str, bytes, Mapping[str, str]],
    settings: CoordinatorSettings,
    now: float,
) -> None:
    """Verify a signed request and burn its nonce; a replayed nonce is refused."""
    method, path, body, headers = request
    nonce = verify_request(
        public_key, method, path, body, headers, now=now, max_skew_s=settings.signature_max_skew_s
    )
    try:
        with session.begin_nested():
            session.add(Nonce(node_id=node_id, nonce=nonce, seen_at=now))
    except IntegrityError:
        raise Unauthorized("replayed request (nonce already used)") from None


def authenticate(
    session: Session,
    request: tuple[str, str, bytes, Mapping[str, str]],
    settings: CoordinatorSettings,
    now: float,
) -> Node:
    headers = request[3]
    node = session.get(Node, headers.get(HEADER_NODE, ""))
    if node is None:
        raise Unauthorized("unknown node: register first")
    if node.state == "left":
        raise Unauthorized("this node has left; register again to rejoin")
    check_signature(session, node.public_key, node.id, request, settings, now)
    return node


def register(session: Session, msg: NodeRegister, settings: CoordinatorSettings, now: float) -> Node:
    if msg.kind == "core" and msg.core_token != settings.resolved_core_token():
        raise Forbidden("registering a core node needs the operator's core token")
    node_id = node_id_for(msg.public_key)
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
    if node.online_since is None:  # new, or back after leaving; a restart without leaving stays present
        node.online_since = now
    node.state = "online"
    node.last_heartbeat_at = now
    session.add(node)
    session.flush()
    return node


def beat(node: Node, now: float) -> None:
    node.last_heartbeat_at = now
    node.heartbeats += 1
    node.state = "online"


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


def mark_lost(session: Session, rules: Liveness, now: float) -> list[Node]:
    """Nodes silent for more than ``heartbeat_misses`` intervals are lost (``Liveness.is_lost``)."""
    silent = select(Node).where(Node.state == "online", Node.last_heartbeat_at < rules.lost_deadline(now))
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
