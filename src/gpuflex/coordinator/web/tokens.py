"""Providers' dashboard tokens: a node proves itself once with its key and gets a signed, expiring token.

A provider has no API token (a node is its Ed25519 key), so ``POST /v1/nodes/dashboard-token``,
signed by the node, returns a *link* token good for ``dashboard_link_ttl_s``; opening the link
trades it for a *session* token (``dashboard_session_ttl_s``) kept in an HttpOnly cookie.

A token is ``gfxdash_<payload>.<mac>``: the payload (base64url JSON: node id, purpose, expiry) and an
HMAC-SHA256 of it under the operator's dashboard secret. Nothing is stored, so every coordinator
replica that shares the secret accepts it; a link can be opened more than once until it expires.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Literal

from gpuflex.errors import Unauthorized

PREFIX = "gfxdash_"
Purpose = Literal["link", "session"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: str, payload: str) -> str:
    return _b64(hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest())


def issue(secret: str, node_id: str, purpose: Purpose, expires_at: float) -> str:
    """A token that says "node ``node_id``" for ``purpose`` until ``expires_at`` (unix seconds)."""
    payload = _b64(json.dumps({"node": node_id, "for": purpose, "exp": expires_at}).encode())
    return f"{PREFIX}{payload}.{_mac(secret, payload)}"


def verify(secret: str, token: str, purpose: Purpose, now: float) -> str:
    """The node id a token names, or Unauthorized: malformed, forged, for another purpose, or expired."""
    body = token[len(PREFIX) :] if token.startswith(PREFIX) else ""
    payload, _, mac = body.partition(".")
    if not payload or not hmac.compare_digest(mac.encode(), _mac(secret, payload).encode()):
        raise Unauthorized("this dashboard link is not valid: ask for a new one (gpuflex provider dashboard)")
    claims = json.loads(_unb64(payload))
    if claims.get("for") != purpose:
        raise Unauthorized("this token is not a dashboard sign-in link")
    if float(claims.get("exp", 0)) < now:
        raise Unauthorized("this dashboard link has expired: ask for a new one (gpuflex provider dashboard)")
    return str(claims["node"])
