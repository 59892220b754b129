"""The simulated link: what it counts and how long it makes each call wait, with an injected sleep."""

import pytest

from gpuflex.errors import NotFound
from gpuflex.protocol.messages import ContributionSubmit
from gpuflex.train.throttle import Link, ThrottledTransport
from gpuflex.train.transport import LocalTransport

from .helpers import Publisher, tiny_spec

MBIT = 1e6


class Sleeps(list):
    """An injected ``sleep`` that records instead of waiting."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def _link(bandwidth_bps: float | None = 8 * MBIT, latency_s: float = 0.05, **kw):
    sleeps = Sleeps()
    hub = LocalTransport(rounds=2, live_workers=1)
    return hub, ThrottledTransport(hub, Link(bandwidth_bps, latency_s), sleep=sleeps, **kw), sleeps


def test_link_arithmetic():
    link = Link(bandwidth_bps=100 * MBIT, latency_s=0.05)
    assert link.transfer_s(12_500_000) == pytest.approx(1.0)  # 100 Mbit/s moves 12.5 MB a second
    assert link.delay_s(1_250_000) == pytest.approx(0.05 + 0.1)
    assert Link().delay_s(10**9) == 0.0  # unlimited and instant: a meter only


def test_an_upload_pays_half_the_latency_and_its_bytes_before_the_call_and_half_after():
    hub, link, sleeps = _link()
    digest = link.put_blob(b"x" * 1_000_000)  # 8 Mbit at 8 Mbit/s: one second
    reply = len(digest)  # the reply is the hash
    assert hub.get_blob(digest) == b"x" * 1_000_000
    assert sleeps == pytest.approx([0.025 + 1.0, 0.025 + 8 * reply / (8 * MBIT)])
    stats = link.stats()
    assert (stats.bytes_up, stats.bytes_down, stats.calls) == (1_000_000, reply, 1)
    assert stats.wait_s == pytest.approx(sum(sleeps))
    assert stats.wait_s == pytest.approx(Link(8 * MBIT, 0.05).delay_s(1_000_000 + reply))


def test_a_download_is_paid_after_the_call():
    hub, link, sleeps = _link()
    digest = hub.put_blob(b"y" * 500_000)
    assert link.get_blob(digest) == b"y" * 500_000
    assert sleeps == pytest.approx([0.025 + 8 * 64 / (8 * MBIT), 0.025 + 0.5])
    assert (link.stats().bytes_up, link.stats().bytes_down) == (64, 500_000)


def test_messages_are_counted_as_their_json_and_every_call_pays_the_latency():
    hub, link, sleeps = _link(bandwidth_bps=None, latency_s=0.02)
    assert link.latest_round() is None
    assert link.stats().bytes_down == len("null")
    Publisher(hub, tiny_spec(rounds=2))
    state = link.latest_round()
    assert link.stats().bytes_down == len("null") + len(state.model_dump_json())
    digest = hub.put_blob(b"delta")
    submission = ContributionSubmit(round=0, delta=digest, tokens=10, steps=1, train_loss=2.0)
    assert link.submit_contribution(submission).accepted
    link.log("hello")
    stats = link.stats()
    assert stats.bytes_up == len(submission.model_dump_json()) + len('"hello"')
    assert stats.calls == 4 and sleeps == pytest.approx([0.01] * 8)


def test_preloaded_blobs_cost_nothing():
    hub, _, sleeps = _link()
    dataset = hub.put_blob(b"the corpus")
    free = ThrottledTransport(hub, Link(8 * MBIT, 0.05), preloaded={dataset}, sleep=sleeps)
    assert free.get_blob(dataset) == b"the corpus"
    assert free.stats().calls == 0 and sleeps == []


def test_errors_pass_through_and_cross_nothing():
    _, link, _ = _link()
    with pytest.raises(NotFound, match="no blob"):
        link.get_blob("0" * 64)
    assert link.stats().bytes_down == 0
