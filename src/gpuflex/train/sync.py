"""Bringing a replica to a published round: update by update when close, from a checkpoint otherwise.

A replica one or a few rounds behind fetches each round's small aggregated update and applies it,
checking the published state hash after each. A new replica (joining), one far behind, or one whose
hash disagrees (it drifted) loads the newest full checkpoint and applies the updates after it.

A replica built from the job's seed is round 0 already: when its hash is round 0's, it joins early in
a job by replaying the small updates, and never downloads the dense model.
"""

from __future__ import annotations

from gpuflex.errors import ServiceError
from gpuflex.protocol.messages import RoundState
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.transport import Decoder, Transport, fetch_verified

MAX_UPDATES_TO_REPLAY = 8  # further behind than this, a checkpoint is the cheaper way to catch up


class Drift(Exception):
    """The replica's state hash disagrees with the published one."""


def sync(replica: GlobalReplica, transport: Transport, target: RoundState, decode: Decoder) -> int:
    """Bring ``replica`` to round ``target.round``; returns the bytes it received to get there."""
    if replica.round < 0 and target.round <= MAX_UPDATES_TO_REPLAY and _is_round_zero(replica, transport):
        replica.round = 0
    if replica.round == target.round:
        return 0
    near = 0 <= replica.round < target.round and target.round - replica.round <= MAX_UPDATES_TO_REPLAY
    if near:
        try:
            return _replay(replica, transport, target.round, decode)
        except Drift as drift:
            transport.log(f"replica drifted ({drift}); reloading the checkpoint")
    received = _load_checkpoint(replica, transport, target)
    try:
        return received + _replay(replica, transport, target.round, decode)
    except Drift as drift:
        raise ServiceError(f"cannot reproduce the global state even from the checkpoint: {drift}") from None


def _is_round_zero(replica: GlobalReplica, transport: Transport) -> bool:
    """Whether the fresh ``replica`` (no outer state yet) is exactly the job's published round 0."""
    return not replica.outer.state and replica.state_hash() == transport.round_state(0).state_hash


def _load_checkpoint(replica: GlobalReplica, transport: Transport, target: RoundState) -> int:
    if target.checkpoint is None or target.checkpoint_round > target.round:
        raise ServiceError(f"round {target.round} has no checkpoint to join from")
    data = fetch_verified(transport, target.checkpoint)
    replica.load(data)
    if replica.round != target.checkpoint_round:
        raise ServiceError(f"checkpoint says round {replica.round}, expected {target.checkpoint_round}")
    return len(data)


def _replay(replica: GlobalReplica, transport: Transport, until: int, decode: Decoder) -> int:
    received = 0
    while replica.round < until:
        state = transport.round_state(replica.round + 1)
        data = fetch_verified(transport, state.update)
        received += len(data)
        replica.apply(decode(data))
        if replica.state_hash() != state.state_hash:
            raise Drift(f"round {state.round}: hash {replica.state_hash()[:12]} != {state.state_hash[:12]}")
    return received
