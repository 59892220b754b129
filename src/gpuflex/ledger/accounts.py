"""Account names. One string per account, ``<kind>:<id>``, so a journal line reads on its own.

``WORLD`` is the outside: deposits come from it and withdrawals go to it, so its balance is the
negative of all money inside and the sum over *all* accounts is always exactly zero. It is the
only account allowed to go negative; every other balance is money somebody actually holds.
"""

from __future__ import annotations

from gpuflex.errors import BadRequest

WORLD = "world"
PLATFORM_FEES = "platform:fees"
SLASHED = "platform:slashed"  # stake taken from nodes found cheating, by verdict
STAKES = "stake:"  # what every ``stake`` account's name starts with
HELD = "held:"  # and every ``held`` account's


def _named(kind: str, ident: str) -> str:
    if not isinstance(ident, str) or not ident:
        raise BadRequest(f"{kind} account needs a non-empty id, got {ident!r}")
    return f"{kind}:{ident}"


def consumer(account_id: str) -> str:
    """A consumer's spendable balance."""
    return _named("consumer", account_id)


def provider(node_id: str) -> str:
    """A provider node's earnings."""
    return _named("provider", node_id)


def escrow(job_id: str) -> str:
    """Money set aside for one job: filled at submission, emptied by its settlement."""
    return _named("escrow", job_id)


def stake(node_id: str) -> str:
    """A provider node's bonded stake: what a verdict against it can take (``SLASHED``)."""
    return _named("stake", node_id)


def held(job_id: str, node_id: str) -> str:
    """A node's pay for one job, held until the job's audit window passes (then to ``provider``)."""
    for kind, ident in (("job", job_id), ("node", node_id)):
        if not isinstance(ident, str) or not ident or "/" in ident:
            raise BadRequest(f"held account needs a {kind} id without '/', got {ident!r}")
    return held_for_job(job_id) + node_id


def held_for_job(job_id: str) -> str:
    """What the names of a job's held accounts start with."""
    return f"{HELD}{job_id}/"


def may_go_negative(account: str) -> bool:
    return account == WORLD
