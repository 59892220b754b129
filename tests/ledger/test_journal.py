import dataclasses
import hashlib
import re
from datetime import UTC

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gpuflex.auth.signing import NodeKey
from gpuflex.errors import BadRequest, InsufficientFunds
from gpuflex.ledger.accounts import PLATFORM_FEES, WORLD, consumer, escrow, provider
from gpuflex.ledger.export import from_export, to_export, verify_export
from gpuflex.ledger.journal import (
    GENESIS_HASH,
    Entry,
    balances,
    check_funds,
    entry_hash,
    make_entry,
    signed_message,
    verify_chain,
)
from gpuflex.protocol.messages import LedgerExport

AT = "2025-01-01T00:00:00+00:00"
COORDINATOR = NodeKey.generate()  # the key that signs the journal
MALLORY = NodeKey.generate()  # an attacker with write access to the database, not to that key
PUBLIC = COORDINATOR.public_key_hex
INSIDE = [consumer("a"), consumer("b"), provider("n1"), provider("n2"), escrow("j1"), PLATFORM_FEES]
timestamps = st.datetimes(timezones=st.just(UTC)).map(lambda t: t.isoformat())


@st.composite
def postings_for(draw, bal: dict[str, int]) -> tuple[str, list[tuple[str, int]]]:
    """A deposit from WORLD, or a transfer/withdrawal from a funded account split over 1-3 targets."""
    funded = [a for a in INSIDE if bal.get(a, 0) > 0]
    if not funded or draw(st.booleans()):
        amount = draw(st.integers(1, 10**12))
        return "deposit", [(WORLD, -amount), (draw(st.sampled_from(INSIDE)), amount)]
    src = draw(st.sampled_from(funded))
    amount = draw(st.integers(1, bal[src]))
    targets = draw(st.lists(st.sampled_from([*INSIDE, WORLD]), min_size=1, max_size=3, unique=True))
    targets = [t for t in targets if t != src][:amount] or [WORLD]
    share = amount // len(targets)
    pieces = [share] * (len(targets) - 1) + [amount - share * (len(targets) - 1)]
    return "transfer", [(src, -amount), *zip(targets, pieces, strict=True)]


@st.composite
def chains(draw, min_size: int = 1, max_size: int = 10) -> list[Entry]:
    entries: list[Entry] = []
    for _ in range(draw(st.integers(min_size, max_size))):
        bal = balances(entries)
        kind, postings = draw(postings_for(bal))
        check_funds(bal, postings)
        memo = draw(st.text(max_size=20))
        prev = entries[-1] if entries else None
        entry = make_entry(prev, at=draw(timestamps), kind=kind, memo=memo, postings=postings)
        entries.append(signed(entry))
    return entries


def signed(entry: Entry, key: NodeKey = COORDINATOR) -> Entry:
    return dataclasses.replace(entry, signature=key.private_key.sign(signed_message(entry.hash)).hex())


def rehashed(entries: list[Entry], i: int, **changes) -> list[Entry]:
    """The journal an attacker makes: entry ``i`` changed, it and every later entry re-hashed and
    relinked consistently; the old signatures are kept (the attacker has not the coordinator's key)."""
    out = entries[:i]
    for k, e in enumerate(entries[i:]):
        fields = {"at": e.at, "kind": e.kind, "memo": e.memo, "postings": e.postings}
        forged = make_entry(out[-1] if out else None, **(fields | changes if k == 0 else fields))
        out.append(dataclasses.replace(forged, signature=e.signature))
    return out


def names_seq(problem: str | None, seq: int) -> bool:
    return problem is not None and re.search(rf"\bseq {seq}\b", problem) is not None


@given(chains())
def test_valid_transfers_verify_and_sum_to_zero(entries):
    report = verify_chain(entries, public_key=PUBLIC)
    assert report.ok, report.problem
    assert report.public_key == PUBLIC
    assert verify_chain(entries).ok
    assert report.entries == len(entries)
    assert report.head == entries[-1].hash
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    bal = balances(entries)
    assert sum(bal.values()) == 0
    assert all(v >= 0 for a, v in bal.items() if a != WORLD)
    assert verify_chain(entries, expected_head=entries[-1].hash).ok


@given(chains())
def test_export_round_trip_through_json(entries):
    exported = LedgerExport.model_validate_json(to_export(entries, public_key=PUBLIC).model_dump_json())
    assert from_export(exported) == entries
    assert exported.public_key == PUBLIC
    report = verify_export(exported)
    assert report.ok and report.public_key == PUBLIC, report.problem
    assert verify_export(exported, public_key=PUBLIC.upper()).ok


def _tamper(e: Entry, field: str, data) -> Entry:
    if field in ("amount", "account"):
        j = data.draw(st.integers(0, len(e.postings) - 1))
        account, amount = e.postings[j]
        if field == "amount":
            changed = (account, amount + data.draw(st.integers(-(10**6), 10**6).filter(bool)))
        else:
            changed = (account + "x", amount)
        postings = (*e.postings[:j], changed, *e.postings[j + 1 :])
        return dataclasses.replace(e, postings=postings)
    if field == "seq":
        return dataclasses.replace(e, seq=e.seq + data.draw(st.integers(-5, 5).filter(bool)))
    if field in ("prev_hash", "hash", "signature"):
        old = getattr(e, field)
        return dataclasses.replace(e, **{field: ("1" if old[0] != "1" else "2") + old[1:]})
    return dataclasses.replace(e, **{field: getattr(e, field) + "x"})


@given(
    chains(),
    st.sampled_from(["amount", "account", "memo", "seq", "prev_hash", "hash", "at", "kind", "signature"]),
    st.data(),
)
def test_any_change_fails_and_names_the_entry(entries, field, data):
    i = data.draw(st.integers(0, len(entries) - 1))
    tampered = [*entries[:i], _tamper(entries[i], field, data), *entries[i + 1 :]]
    report = verify_chain(tampered, public_key=PUBLIC)
    assert not report.ok
    assert report.entries == i
    assert names_seq(report.problem, entries[i].seq), report.problem


@given(chains(), st.data())
def test_a_consistently_rehashed_journal_fails_on_its_signature(entries, data):
    i = data.draw(st.integers(0, len(entries) - 1))
    forged = rehashed(entries, i, memo=entries[i].memo + " (edited)")
    assert verify_chain(forged).ok  # the hash chain alone cannot tell
    report = verify_chain(forged, public_key=PUBLIC)
    assert not report.ok and report.entries == i
    assert report.problem == f"seq {i + 1}: signature does not verify against the public key " + (
        "(signed by another key, or forged)"
    )


@given(chains(), st.data())
def test_a_journal_re_signed_by_another_key_fails_against_the_trusted_key(entries, data):
    i = data.draw(st.integers(0, len(entries) - 1))
    forged = [signed(e, MALLORY) for e in rehashed(entries, i, memo=entries[i].memo + " (edited)")]
    assert not verify_chain(forged, public_key=PUBLIC).ok
    assert verify_chain(forged, public_key=MALLORY.public_key_hex).ok
    # The forger's export names the forger's key: pinning the key you trust catches it.
    export = to_export(forged, public_key=MALLORY.public_key_hex)
    with pytest.raises(BadRequest) as mismatch:
        verify_export(export, public_key=PUBLIC)
    assert mismatch.value.message == (
        f"key mismatch: the export is signed by key {MALLORY.public_key_hex}, not by the key you trust "
        f"({PUBLIC}); its entries were not checked"
    )
    # An export that names no key is checked against the pinned key, entry by entry.
    report = verify_export(to_export(forged), public_key=PUBLIC)
    assert not report.ok and names_seq(report.problem, 1), report.problem


@given(chains(min_size=2), st.data())
def test_reordering_fails(entries, data):
    order = data.draw(st.permutations(range(len(entries))).filter(lambda p: list(p) != sorted(p)))
    report = verify_chain([entries[k] for k in order])
    assert not report.ok
    first_moved = next(pos for pos, k in enumerate(order) if k != pos)
    assert report.entries == first_moved
    assert names_seq(report.problem, first_moved + 1), report.problem


@given(chains(min_size=2), st.data())
def test_deleting_an_entry_fails(entries, data):
    i = data.draw(st.integers(0, len(entries) - 2))
    report = verify_chain(entries[:i] + entries[i + 1 :])
    assert not report.ok
    assert names_seq(report.problem, i + 1), report.problem


def test_truncated_tail_needs_a_trusted_head():
    e1 = make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)])
    e2 = make_entry(e1, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)])
    assert verify_chain([e1]).ok
    report = verify_chain([e1], expected_head=e2.hash)
    assert not report.ok
    assert "head" in report.problem


def _forge(prev: Entry | None, postings) -> Entry:
    """An entry with a correct hash and link but content make_entry would refuse."""
    seq, prev_hash = (prev.seq + 1, prev.hash) if prev else (1, GENESIS_HASH)
    postings = tuple(postings)
    return Entry(
        seq, AT, "forged", "", postings, prev_hash, entry_hash(seq, AT, "forged", "", postings, prev_hash)
    )


def test_unbalanced_entry_fails():
    e1 = make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)])
    report = verify_chain([e1, _forge(e1, [(WORLD, -5), (consumer("a"), 6)])])
    assert not report.ok and report.entries == 1
    assert report.problem.startswith("seq 2: postings not balanced")


def test_negative_balance_fails():
    e1 = make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)])
    e2 = make_entry(e1, at=AT, kind="withdrawal", memo="", postings=[(consumer("a"), -6), (WORLD, 6)])
    report = verify_chain([e1, e2])
    assert not report.ok
    assert report.problem == "seq 2: account consumer:a balance goes negative (-1)"
    assert report.head == e1.hash


def test_an_unsigned_entry_fails_when_signatures_are_checked():
    e1 = signed(make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)]))
    e2 = make_entry(e1, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)])
    assert verify_chain([e1, e2]).ok
    report = verify_chain([e1, e2], public_key=PUBLIC)
    assert not report.ok and report.entries == 1
    assert report.problem == "seq 2: the entry is not signed"


@pytest.mark.parametrize("key", ["", "zz" * 32, "ab" * 31])
def test_a_malformed_public_key_is_a_clear_problem(key):
    e1 = signed(make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)]))
    report = verify_chain([e1], public_key=key)
    assert not report.ok and report.entries == 0
    assert "is not a hex Ed25519 public key" in report.problem


def test_an_export_naming_no_key_needs_one_pinned():
    e1 = signed(make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)]))
    with pytest.raises(BadRequest, match="names no public key"):
        verify_export(to_export([e1]))
    assert verify_export(to_export([e1]), public_key=PUBLIC).ok


@pytest.mark.parametrize("key", ["00", "", "zz" * 32, "ab" * 31, "ab" * 33])
def test_a_pinned_key_that_is_not_a_key_is_refused_before_any_entry_is_checked(key):
    e1 = signed(make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)]))
    with pytest.raises(BadRequest) as err:
        verify_export(to_export([e1], public_key=PUBLIC), public_key=key)
    assert err.value.message == f"{key!r} is not an Ed25519 public key: a key is 64 hex digits"


def test_empty_chain_is_ok():
    assert verify_chain([]) == verify_chain([], expected_head=GENESIS_HASH)
    assert verify_chain([]).head == GENESIS_HASH


def test_entry_hash_is_sha256_of_canonical_json():
    canonical = (
        '{"at":"2025-01-01T00:00:00+00:00","kind":"deposit","memo":"caf\\u00e9","postings":[["world",-5],'
        '["consumer:a",5]],"prev_hash":"' + GENESIS_HASH + '","seq":1}'
    )
    got = entry_hash(1, AT, "deposit", "café", [(WORLD, -5), (consumer("a"), 5)], GENESIS_HASH)
    assert got == hashlib.sha256(canonical.encode()).hexdigest()


def test_make_entry_links():
    e1 = make_entry(None, at=AT, kind="deposit", memo="m", postings=[(WORLD, -5), (consumer("a"), 5)])
    e2 = make_entry(e1, at="2025-01-01T00:00:01Z", kind="deposit", memo="", postings=[(WORLD, -1), ("x", 1)])
    assert (e1.seq, e1.prev_hash) == (1, GENESIS_HASH)
    assert (e2.seq, e2.prev_hash) == (2, e1.hash)
    assert e1.postings == ((WORLD, -5), (consumer("a"), 5))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"postings": [(WORLD, -5)]}, "at least two postings"),
        ({"postings": []}, "at least two postings"),
        ({"postings": [(WORLD, 0), ("a", 0)]}, "nonzero integer"),
        ({"postings": [(WORLD, -1.5), ("a", 1.5)]}, "nonzero integer"),
        ({"postings": [(WORLD, -1), ("a", True)]}, "nonzero integer"),
        ({"postings": [(WORLD, -5), ("a", 4)]}, "not balanced"),
        ({"postings": [(WORLD, -5), ("", 5)]}, "non-empty"),
        ({"postings": [(WORLD, -5), (None, 5)]}, "non-empty"),
        ({"at": "yesterday"}, "ISO-8601"),
        ({"at": "2025-01-01T00:00:00"}, "UTC"),
        ({"at": "2025-01-01T00:00:00+02:00"}, "UTC"),
        ({"kind": ""}, "kind"),
        ({"memo": None}, "memo"),
        ({"kind": "governance"}, "moves no money"),
    ],
)
def test_make_entry_rejects(changes, message):
    args = {"at": AT, "kind": "deposit", "memo": "", "postings": [(WORLD, -5), (consumer("a"), 5)]} | changes
    with pytest.raises(BadRequest, match=message):
        make_entry(None, **args)


def test_a_record_entry_moves_no_money_and_chains_like_any_other():
    deposit = make_entry(None, at=AT, kind="deposit", memo="m", postings=[(WORLD, -5), (consumer("a"), 5)])
    vote = make_entry(deposit, at=AT, kind="governance", memo="vote yes on proposal 1", postings=[])
    assert vote.postings == () and vote.prev_hash == deposit.hash
    assert verify_chain([deposit, vote]).ok
    assert balances([deposit, vote]) == {WORLD: -5, consumer("a"): 5}


def test_a_record_entry_is_signed_and_verified_like_any_other():
    journal = [
        signed(make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), (consumer("a"), 5)]))
    ]
    journal.append(signed(make_entry(journal[0], at=AT, kind="governance", memo="vote yes", postings=[])))
    assert verify_chain(journal, public_key=PUBLIC).ok
    report = verify_chain([journal[0], dataclasses.replace(journal[1], signature="")], public_key=PUBLIC)
    assert report.problem == "seq 2: the entry is not signed"
    report = verify_chain(rehashed(journal, 1, memo="vote no"), public_key=PUBLIC)
    assert not report.ok and report.problem.startswith("seq 2: signature does not verify")


def test_check_funds():
    bal = {consumer("a"): 10, WORLD: -10}
    check_funds(bal, [(consumer("a"), -10), (escrow("j"), 10)])
    check_funds(bal, [(WORLD, -(10**9)), (consumer("b"), 10**9)])
    with pytest.raises(InsufficientFunds, match=r"consumer:a holds 0\.000010 credits, needs 0\.000011"):
        check_funds(bal, [(consumer("a"), -11), (escrow("j"), 11)])
    with pytest.raises(InsufficientFunds, match=r"consumer:b holds 0\.000000"):
        check_funds(bal, [(consumer("b"), -1), (escrow("j"), 1)])


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("hash"),
        lambda d: d.update(extra=1),
        lambda d: d.update(seq="one"),
        lambda d: d.update(memo=3),
        lambda d: d.update(postings=[{"account": "world", "amount": -1.5}, {"account": "a", "amount": 1.5}]),
        lambda d: d.update(postings=[{"account": "world"}]),
        lambda d: d.update(postings="world"),
    ],
)
def test_a_malformed_export_is_refused(change):
    entry = make_entry(None, at=AT, kind="deposit", memo="", postings=[(WORLD, -5), ("a", 5)])
    d = to_export([entry]).model_dump()["entries"][0]
    change(d)
    with pytest.raises(ValidationError):
        LedgerExport.model_validate({"entries": [d]})
