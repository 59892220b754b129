"""The relay's rules for secure-aggregation messages (``SecAggPost``), one definition for the coordinator
and ``LocalTransport``: who may post what, who reads what, and the two refusals that keep an attempt that
is started over from ever being masked in (``train.secure``).
"""

from __future__ import annotations

import json

from gpuflex.errors import BadRequest, Conflict, Forbidden
from gpuflex.protocol.messages import SecAggMessage, SecAggPost

AGGREGATOR = "aggregator"
_AGGREGATOR_KINDS = {"roster", "request"}


def check_post(existing: list[SecAggMessage], post: SecAggPost, sender: str, from_aggregator: bool) -> bool:
    """Whether ``post`` (from task ``sender``) is new; False for a retry of a message already stored.

    ``existing``: every message of the post's round. Refused: a kind the sender's role does not post, a
    second, different message of the same kind and attempt from one sender, a roster that does not start
    the next attempt or that would replace one whose members have all shared, and shares of an attempt a
    newer roster replaced."""
    if (post.kind in _AGGREGATOR_KINDS) != from_aggregator:
        poster = "the aggregator" if post.kind in _AGGREGATOR_KINDS else "a worker"
        raise Forbidden(f"a {post.kind} message is {poster}'s to post")
    if post.kind == "reveal" and post.to != AGGREGATOR:
        raise BadRequest("a reveal goes to the aggregator alone (to: aggregator)")
    if post.kind == "roster":
        _tasks(post.body)
    for m in existing:
        if (m.attempt, m.kind, m.sender) == (post.attempt, post.kind, sender):
            if m.body != post.body or m.to != post.to:
                raise Conflict(
                    f"round {post.round}: {sender} already posted its {post.kind} of attempt {post.attempt}"
                )
            return False
    rosters = {m.attempt: m for m in existing if m.kind == "roster"}
    newest = max(rosters, default=-1)
    if post.kind == "roster":
        if post.attempt != newest + 1:
            raise Conflict(f"round {post.round}: the next attempt is {newest + 1}, not {post.attempt}")
        if newest >= 0:
            members = set(_tasks(rosters[newest].body))
            shared = {m.sender for m in existing if m.attempt == newest and m.kind == "shares"}
            if members <= shared:
                raise Conflict(f"round {post.round}: every owner of attempt {newest} shared: it goes on")
    elif post.attempt != newest:
        raise Conflict(f"round {post.round}: attempt {post.attempt} is not the current one ({newest})")
    elif post.kind != "request" and sender not in _tasks(rosters[newest].body):
        raise Forbidden(f"round {post.round}: {sender} is not in attempt {post.attempt}'s roster")
    return True


def visible(message: SecAggMessage, reader: str, is_aggregator: bool) -> bool:
    """The aggregator reads every message; a worker those to everyone and to itself."""
    return is_aggregator or message.to in ("*", reader)


def _tasks(body: str) -> list[str]:
    try:
        tasks = json.loads(body)["tasks"]
    except (ValueError, KeyError, TypeError):
        tasks = None
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
        raise BadRequest('a roster names its tasks: {"tasks": ["<task id>", ...]}')
    return tasks
