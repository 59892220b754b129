"""The Transport contract, run over every implementation (only LocalTransport so far)."""

from collections.abc import Callable

import pytest

from gpuflex.errors import BadRequest, Conflict, NotFound, ServiceError
from gpuflex.protocol.messages import ContributionSubmit, RoundPublish
from gpuflex.train.checkpoint import sha256
from gpuflex.train.transport import LocalTransport, fetch_verified, wait_for_round

Factory = Callable[[int, int], LocalTransport]  # (rounds, live_workers) -> transport


@pytest.fixture(params=["local"])
def make(request) -> Factory:
    return lambda rounds, live_workers: LocalTransport(rounds, live_workers)


def _publish(t: LocalTransport, round: int, *, checkpoint: bool = True) -> str | None:
    """Publish ``round`` with a stand-in update and (by default) a stand-in full state."""
    update = t.put_blob(f"update {round}".encode()) if round > 0 else None
    state = t.put_blob(f"state {round}".encode()) if checkpoint else None
    t.publish_round(
        RoundPublish(round=round, state_hash=sha256(b"%d" % round), update=update, checkpoint=state)
    )
    return state


def _submit(t: LocalTransport, round: int, payload: bytes = b"delta") -> bool:
    digest = t.put_blob(payload)
    return t.submit_contribution(
        ContributionSubmit(round=round, delta=digest, tokens=10, steps=1, train_loss=1.0)
    ).accepted


def test_blobs_are_content_addressed(make: Factory):
    t = make(2, 1)
    digest = t.put_blob(b"hello")
    assert digest == sha256(b"hello")
    assert t.get_blob(digest) == b"hello"
    assert fetch_verified(t, digest) == b"hello"
    with pytest.raises(NotFound):
        t.get_blob(sha256(b"never stored"))


def test_rounds_publish_in_order_and_finish(make: Factory):
    t = make(2, 1)
    assert t.latest_round() is None
    with pytest.raises(Conflict):
        _publish(t, 1)
    state0 = _publish(t, 0)
    latest = t.latest_round()
    assert (latest.round, latest.checkpoint, latest.checkpoint_round, latest.finished) == (
        0,
        state0,
        0,
        False,
    )
    with pytest.raises(Conflict):
        _publish(t, 0)
    with pytest.raises(BadRequest, match="never uploaded"):
        t.publish_round(RoundPublish(round=1, state_hash="0" * 64, update=sha256(b"missing")))
    with pytest.raises(BadRequest, match="aggregated update"):
        t.publish_round(RoundPublish(round=1, state_hash="0" * 64))
    _publish(t, 1, checkpoint=False)
    assert (t.latest_round().checkpoint, t.latest_round().checkpoint_round) == (state0, 0)
    assert t.round_state(1).update == t.put_blob(b"update 1")
    with pytest.raises(BadRequest, match="full state"):
        _publish(t, 2, checkpoint=False)
    _publish(t, 2)
    assert t.latest_round().finished
    with pytest.raises(Conflict):
        _publish(t, 3)


def test_a_closed_round_refuses_contributions(make: Factory):
    t = make(3, 2)
    with pytest.raises(Conflict, match="not started"):
        _submit(t, 0)
    _publish(t, 0)
    assert _submit(t.for_task("w0"), 0)
    _publish(t, 1)
    assert _submit(t.for_task("w1"), 0) is False  # stale: round 0 closed when round 1 was published
    assert [c.task_id for c in t.contributions(0).contributions] == ["w0"]
    assert _submit(t.for_task("w1"), 1)
    with pytest.raises(Conflict):
        _submit(t, 2)
    _publish(t, 2)
    _publish(t, 3)
    assert _submit(t.for_task("w1"), 3) is False  # the job has finished


def test_contributions_are_per_task_and_a_resubmission_replaces(make: Factory):
    t = make(3, 2)
    _publish(t, 0)
    assert _submit(t.for_task("w0"), 0, b"first")
    assert _submit(t.for_task("w1"), 0, b"other")
    assert _submit(t.for_task("w0"), 0, b"second")
    listing = t.contributions(0)
    assert listing.live_workers == 2
    by_task = {c.task_id: c.delta for c in listing.contributions}
    assert by_task == {"w0": sha256(b"second"), "w1": sha256(b"other")}
    with pytest.raises(BadRequest, match="never uploaded"):
        t.submit_contribution(
            ContributionSubmit(round=0, delta=sha256(b"nothing"), tokens=1, steps=1, train_loss=0.0)
        )
    t.set_live_workers(1)
    assert t.contributions(0).live_workers == 1
    assert t.contributions(5).contributions == []


def test_logs_are_attributed_and_echoed():
    lines: list[str] = []
    t = LocalTransport(1, 1, echo=lines.append)
    t.for_task("w3").log("hello")
    assert t.logs() == [("w3", "hello")]
    assert lines == ["[w3] hello"]


def test_fetch_verified_refuses_corrupted_bytes():
    class Corrupting(LocalTransport):
        def get_blob(self, digest: str) -> bytes:
            return super().get_blob(digest) + b"!"

    t = Corrupting(1, 1)
    digest = t.put_blob(b"model")
    with pytest.raises(ServiceError, match="corrupted"):
        fetch_verified(t, digest)


def test_wait_for_round_returns_newer_or_finished_or_none_when_stopped(make: Factory):
    t = make(1, 1)
    assert wait_for_round(t, -1, 0.001, should_stop=lambda: True) is None
    _publish(t, 0)
    assert wait_for_round(t, -1, 0.001, should_stop=lambda: False).round == 0
    calls = iter(range(3))
    assert wait_for_round(t, 0, 0.001, should_stop=lambda: next(calls) >= 2) is None
    _publish(t, 1)
    assert wait_for_round(t, 5, 0.001, should_stop=lambda: False).finished


def test_a_sealed_transport_stores_only_ciphertext_and_opens_what_it_fetches():
    from gpuflex.privacy.envelope import new_data_key
    from gpuflex.train.transport import LocalTransport, SealedTransport, fetch_verified

    inner = LocalTransport(rounds=1, live_workers=1)
    sealed, other = SealedTransport(inner, new_data_key()), SealedTransport(inner, new_data_key())
    digest = sealed.put_blob(b"weights of the secret model")
    assert b"secret" not in inner.get_blob(digest)
    assert fetch_verified(sealed, digest) == b"weights of the secret model"
    with pytest.raises(BadRequest, match="another job's data key"):
        other.get_blob(digest)
    assert sealed.latest_round() is None  # the rest goes through as it is
