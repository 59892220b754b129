"""The journal: an append-only list of balanced entries, each hashing its predecessor.

An entry moves money between accounts with *postings* ``(account, micro_credits)`` that sum to
zero, so money is conserved by construction. Each entry's hash covers its content and the
previous entry's hash; changing, dropping or reordering any entry breaks every later link, and
``verify_chain`` names the first entry that is wrong. A truncated tail cannot be seen from the
entries alone: compare the report's ``head`` with a head you trust (pass ``expected_head``).

The hash is sha256 of canonical JSON (sorted keys, no spaces, ASCII escapes, postings as
``[[account, amount], ...]`` in entry order), so any language can recompute it.

The coordinator signs each entry's hash with its Ed25519 ledger key (``signed_message``): the hash
chain alone shows a change made by someone who did not recompute the hashes; the signatures also
refuse a journal an attacker re-hashed and relinked consistently, since only the coordinator's key
signs. Give ``verify_chain`` the public key you trust and it checks every signature too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gpuflex.errors import BadRequest, InsufficientFunds
from gpuflex.ledger.accounts import may_go_negative
from gpuflex.protocol.money import to_credits

GENESIS_HASH = "0" * 64
# Kinds that record a decision rather than move money (a governance proposal, a vote): no postings.
RECORD_KINDS = frozenset({"governance"})

Postings = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Entry:
    seq: int
    at: str  # ISO-8601, UTC; passed in by the caller, never read from a clock here
    kind: str  # e.g. "deposit", "escrow", "settlement", "withdrawal"
    memo: str
    postings: Postings
    prev_hash: str
    hash: str
    signature: str = ""  # hex Ed25519 signature of signed_message(hash); "" until the coordinator signs


@dataclass(frozen=True)
class ChainReport:
    """``entries`` counts the entries that verified; ``head`` is the hash of the last of them.

    ``public_key`` is the key every verified entry's signature was checked against (None: not checked).
    """

    ok: bool
    entries: int
    head: str
    problem: str | None = None
    public_key: str | None = None


def entry_hash(
    seq: int, at: str, kind: str, memo: str, postings: Iterable[tuple[str, int]], prev_hash: str
) -> str:
    body = {
        "seq": seq,
        "at": at,
        "kind": kind,
        "memo": memo,
        "postings": [[account, amount] for account, amount in postings],
        "prev_hash": prev_hash,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def signed_message(hash_hex: str) -> bytes:
    """The bytes the coordinator signs for an entry: a label (so the signature means nothing else) and
    the entry's hash, which covers its content and its predecessor."""
    return b"gpuflex journal entry " + hash_hex.encode()


def _content_problem(at: object, kind: object, postings: Postings) -> str | None:
    """What makes an entry's content invalid, or None. Shared by make_entry and verify_chain."""
    if not isinstance(at, str) or not _is_utc_iso(at):
        return f"time {at!r} is not an ISO-8601 UTC timestamp"
    if not isinstance(kind, str) or not kind:
        return "kind must be a non-empty string"
    if kind in RECORD_KINDS:
        return f"a {kind} entry records a decision and moves no money" if postings else None
    if len(postings) < 2:
        return f"needs at least two postings, got {len(postings)}"
    for account, amount in postings:
        if not isinstance(account, str) or not account:
            return f"posting account {account!r} must be a non-empty string"
        if type(amount) is not int or amount == 0:
            return f"posting to {account} must be a nonzero integer of micro-credits, got {amount!r}"
    total = sum(amount for _, amount in postings)
    if total != 0:
        return f"postings not balanced: they sum to {total}, not 0"
    return None


def _is_utc_iso(at: str) -> bool:
    try:
        parsed = datetime.fromisoformat(at)
    except ValueError:
        return False
    return parsed.utcoffset() == timedelta(0)


def make_entry(
    prev: Entry | None, *, at: str, kind: str, memo: str, postings: Iterable[tuple[str, int]]
) -> Entry:
    """The entry that follows ``prev`` (None: the first entry). Raises BadRequest on invalid content.

    It does not know balances: call ``check_funds`` first to refuse an overdraft.
    """
    posts: Postings = tuple((account, amount) for account, amount in postings)
    problem = _content_problem(at, kind, posts)
    if problem:
        raise BadRequest(f"ledger entry refused: {problem}")
    if not isinstance(memo, str):
        raise BadRequest("ledger entry refused: memo must be a string")
    seq = prev.seq + 1 if prev else 1
    prev_hash = prev.hash if prev else GENESIS_HASH
    return Entry(seq, at, kind, memo, posts, prev_hash, entry_hash(seq, at, kind, memo, posts, prev_hash))


def check_funds(balances: Mapping[str, int], postings: Iterable[tuple[str, int]]) -> None:
    """Raise InsufficientFunds if these postings would take any account but WORLD below zero."""
    after: dict[str, int] = {}
    for account, amount in postings:
        after[account] = after.get(account, balances.get(account, 0)) + amount
    for account in sorted(after):
        if after[account] < 0 and not may_go_negative(account):
            have = balances.get(account, 0)
            need = have - after[account]
            raise InsufficientFunds(
                f"{account} holds {to_credits(have):.6f} credits, needs {to_credits(need):.6f}"
            )


def verify_chain(
    entries: Iterable[Entry], *, expected_head: str | None = None, public_key: str | None = None
) -> ChainReport:
    """Check order, links, hashes, balance and that no non-WORLD balance ever goes negative; with
    ``public_key`` (hex Ed25519, the coordinator's that you trust) also every entry's signature.

    Stops at the first problem, which names the entry's seq and what is wrong.
    """
    key = None
    if public_key is not None:
        key = _public_key(public_key)
        if key is None:
            problem = f"public key {public_key!r} is not a hex Ed25519 public key (64 hex digits)"
            return ChainReport(ok=False, entries=0, head=GENESIS_HASH, problem=problem)
    running: dict[str, int] = {}
    head, count = GENESIS_HASH, 0
    for e in entries:
        problem = _entry_problem(e, count + 1, head, running, key)
        if problem:
            return ChainReport(ok=False, entries=count, head=head, problem=problem, public_key=public_key)
        head, count = e.hash, count + 1
    if expected_head is not None and head != expected_head:
        problem = f"head after seq {count} is {head}, expected {expected_head} (entries missing or added)"
        return ChainReport(ok=False, entries=count, head=head, problem=problem, public_key=public_key)
    return ChainReport(ok=True, entries=count, head=head, public_key=public_key)


def _public_key(hex_key: str) -> Ed25519PublicKey | None:
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(hex_key))
    except ValueError:
        return None


def _signature_problem(e: Entry, key: Ed25519PublicKey) -> str | None:
    if not e.signature:
        return "the entry is not signed"
    try:
        key.verify(bytes.fromhex(e.signature), signed_message(e.hash))
    except (InvalidSignature, ValueError):
        return "signature does not verify against the public key (signed by another key, or forged)"
    return None


def _entry_problem(
    e: Entry, want_seq: int, prev_hash: str, running: dict[str, int], key: Ed25519PublicKey | None
) -> str | None:
    """Check one entry against its predecessor; on success, apply it to ``running`` balances."""
    if e.seq != want_seq:
        return f"seq {e.seq}: bad seq order, expected seq {want_seq}"
    if e.prev_hash != prev_hash:
        return f"seq {e.seq}: prev_hash mismatch, it does not link to the entry before it"
    postings = tuple(e.postings)
    if e.hash != entry_hash(e.seq, e.at, e.kind, e.memo, postings, e.prev_hash):
        return f"seq {e.seq}: hash mismatch, the entry's content was changed"
    if key is not None and (problem := _signature_problem(e, key)):
        return f"seq {e.seq}: {problem}"
    if problem := _content_problem(e.at, e.kind, postings):
        return f"seq {e.seq}: {problem}"
    for account, amount in postings:
        running[account] = running.get(account, 0) + amount
    for account, _ in postings:
        if running[account] < 0 and not may_go_negative(account):
            return f"seq {e.seq}: account {account} balance goes negative ({running[account]})"
    return None


def balances(entries: Iterable[Entry]) -> dict[str, int]:
    """Every account any entry touched, with its balance (zero balances included). Does not verify."""
    out: dict[str, int] = {}
    for e in entries:
        for account, amount in e.postings:
            out[account] = out.get(account, 0) + amount
    return out
