"""The gateway's relay: a waiting poll wakes when a request is handed to it, each request goes to the
connected replica with the fewest open, a replica's refusal is the caller's error before any token, a
client that leaves cancels on the replica, a replica that stopped polling takes nothing new, and a
request whose replica is lost (its poll's connection dropped, or no poll for LOST_S) goes on on another
from the tokens read, billed once. The
replica's side is played through the relay's own calls (poll, deliver) on an event loop of its own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from gpuflex.coordinator.relay import LOST_S, STALE_S, WINDOW_S, Relay
from gpuflex.errors import BadRequest, ServiceError
from gpuflex.protocol.relay import (
    RelayCompletion,
    RelayEvent,
    RelayParams,
    RelayPrompt,
    RelayRequest,
    RelayWork,
)
from gpuflex.serve.engine import Cancelled, Event
from gpuflex.serve.sampling import SamplingParams

LIVE = {"l-1", "l-2"}  # the deployment's live leases


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


@pytest.fixture
def caller() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:  # the gateway submits from the thread pool, blocking
        yield pool


def poll(loop, relay: Relay, lease: str, wait_s: float = 5.0) -> Future[RelayWork]:
    return asyncio.run_coroutine_threadsafe(relay.poll(lease, f"hash-of-{lease}", wait_s), loop)


def request(i: int) -> RelayRequest:
    return RelayRequest(id=f"r{i}", prompt=RelayPrompt(text="hi"), params=RelayParams())


def done(request_id: str) -> RelayEvent:
    completion = RelayCompletion(
        prompt=[1],
        tokens=[5, 6],
        text="ab",
        finish_reason="stop",
        seed=3,
        prompt_tokens=1,
        completion_tokens=2,
    )
    return RelayEvent(id=request_id, kind="done", completion=completion)


def test_a_waiting_poll_takes_a_request_at_once_and_its_events_come_back_in_order(loop, caller):
    relay = Relay()
    waiting = poll(loop, relay, "l-1")
    time.sleep(0.1)  # the poll waits
    started = time.monotonic()
    submitted = caller.submit(relay.submit, "d-1", request(1), SamplingParams(), LIVE)
    work = waiting.result(timeout=2)
    assert [r.id for r in work.requests] == ["r1"] and time.monotonic() - started < 0.5
    relay.deliver("l-1", [RelayEvent(id="r1", kind="started")])
    generation = submitted.result(timeout=2)
    counted = []
    generation.on_done = counted.append
    tokens = [
        RelayEvent(id="r1", kind="token", token=5, text="a"),
        RelayEvent(id="r1", kind="token", token=6),
    ]
    relay.deliver("l-1", [*tokens, RelayEvent(id="r2", kind="token", token=9), done("r1")])  # r2: not its own
    assert list(generation) == [Event(5, "a"), Event(6, "")]
    completion = generation.result()
    assert (completion.text, completion.params.seed, completion.usage.completion_tokens) == ("ab", 3, 2)
    assert counted == [completion]
    stats = relay.stats("d-1")
    assert stats.requests_per_s == 1 / WINDOW_S and stats.tokens_per_s == 2 / WINDOW_S
    assert 0 < stats.ttft_p50_ms == stats.ttft_p99_ms < 2000
    assert relay.stats("d-2").requests_per_s is None


def test_requests_go_to_the_replica_with_the_fewest_open_and_a_refusal_is_the_callers_error(loop, caller):
    relay = Relay()
    for lease in ("l-1", "l-2"):
        poll(loop, relay, lease, 0).result(timeout=2)  # both connected
    first = caller.submit(relay.submit, "d-1", request(1), SamplingParams(), LIVE)
    time.sleep(0.1)
    second = caller.submit(relay.submit, "d-1", request(2), SamplingParams(), LIVE)
    time.sleep(0.1)
    taken = {
        lease: [r.id for r in poll(loop, relay, lease, 0).result(timeout=2).requests]
        for lease in ("l-1", "l-2")
    }
    assert sorted(taken.values()) == [["r1"], ["r2"]]
    holder = {ids[0]: lease for lease, ids in taken.items()}
    relay.deliver(holder["r1"], [RelayEvent(id="r1", kind="started")])
    relay.deliver(
        holder["r2"], [RelayEvent(id="r2", kind="error", status=400, message="the prompt is too long")]
    )
    assert first.result(timeout=2) is not None
    with pytest.raises(BadRequest, match="the prompt is too long"):
        second.result(timeout=2)


def test_events_are_taken_from_a_polling_replica_by_its_token_alone(loop):
    now = [0.0]
    relay = Relay(clock=lambda: now[0])
    assert relay.lease_of("hash-of-l-1") is None  # never polled here
    poll(loop, relay, "l-1", 0).result(timeout=2)
    assert relay.lease_of("hash-of-l-1") == "l-1" and relay.lease_of("hash-of-l-2") is None
    now[0] = STALE_S + 1  # it stopped polling
    assert relay.lease_of("hash-of-l-1") is None


def test_the_served_rates_cover_the_last_minute_only(loop, caller):
    now = [0.0]
    relay = Relay(clock=lambda: now[0])
    poll(loop, relay, "l-1", 0).result(timeout=2)
    submitted = caller.submit(relay.submit, "d-1", request(1), SamplingParams(), LIVE)
    time.sleep(0.1)
    poll(loop, relay, "l-1", 0).result(timeout=2)
    relay.deliver("l-1", [RelayEvent(id="r1", kind="started")])
    submitted.result(timeout=2)
    now[0] = 0.25
    relay.deliver("l-1", [RelayEvent(id="r1", kind="token", token=5, text="a")])
    now[0] = 0.5
    relay.deliver("l-1", [done("r1")])
    assert relay.stats("d-1").ttft_p50_ms == 250
    now[0] = 0.5 + WINDOW_S + 0.1
    assert relay.stats("d-1").requests_per_s is None


def test_a_client_that_leaves_cancels_its_request_on_the_replica(loop, caller):
    relay = Relay()
    poll(loop, relay, "l-1", 0).result(timeout=2)
    submitted = caller.submit(relay.submit, "d-1", request(1), SamplingParams(), LIVE)
    time.sleep(0.1)
    poll(loop, relay, "l-1", 0).result(timeout=2)
    relay.deliver("l-1", [RelayEvent(id="r1", kind="started")])
    generation = submitted.result(timeout=2)
    waiting = caller.submit(generation.result)  # a reader waiting for the whole answer
    time.sleep(0.1)
    generation.cancel()
    with pytest.raises(Cancelled):
        waiting.result(timeout=2)  # woken at once, not after the replica's silence
    assert poll(loop, relay, "l-1", 0).result(timeout=2).cancel == ["r1"]


def test_a_deployment_without_a_connected_replica_is_a_503_to_the_caller(loop):
    now = [0.0]
    relay = Relay(clock=lambda: now[0])
    with pytest.raises(ServiceError, match="has no replica serving yet"):
        relay.submit("d-1", request(1), SamplingParams(), LIVE)
    poll(loop, relay, "l-9", 0).result(timeout=2)  # polling, but its lease has ended (scaled away)
    with pytest.raises(ServiceError, match="has no replica serving yet"):
        relay.submit("d-1", request(1), SamplingParams(), LIVE)
    poll(loop, relay, "l-1", 0).result(timeout=2)
    now[0] = STALE_S + 1  # it stopped polling
    with pytest.raises(ServiceError, match="has no replica serving yet"):
        relay.submit("d-1", request(1), SamplingParams(), LIVE)


def test_a_request_whose_replica_drops_its_poll_goes_on_on_another_from_the_tokens_read(loop, caller):
    relay = Relay()
    poll(loop, relay, "l-2", 0).result(timeout=2)
    dropped = asyncio.run_coroutine_threadsafe(_event(), loop).result(timeout=2)
    holding = asyncio.run_coroutine_threadsafe(relay.poll("l-1", "hash-of-l-1", 5, dropped.wait()), loop)
    time.sleep(0.1)
    submitted = caller.submit(relay.submit, "d-1", request(1), SamplingParams(seed=4), {"l-1"})
    assert [r.id for r in holding.result(timeout=2).requests] == ["r1"]
    relay.deliver("l-1", [RelayEvent(id="r1", kind="started")])
    generation = submitted.result(timeout=2)
    generation.leases = frozenset(LIVE)  # l-2 is live for it now
    relay.deliver("l-1", [RelayEvent(id="r1", kind="token", token=5, text="a")])
    events = iter(generation)
    assert next(events) == Event(5, "a")
    rest = caller.submit(list, events)  # the reader waits for the rest
    holding = asyncio.run_coroutine_threadsafe(relay.poll("l-1", "hash-of-l-1", 5, dropped.wait()), loop)
    time.sleep(0.1)
    loop.call_soon_threadsafe(dropped.set)  # kill -9: its poll's connection drops
    assert holding.result(timeout=2) == RelayWork()
    (moved,) = poll(loop, relay, "l-2", 2).result(timeout=2).requests
    assert (moved.resume, moved.params.seed, moved.prompt) == ([5], None, request(1).prompt)
    completion = RelayCompletion(
        prompt=[1], tokens=[5, 6], text="ab", finish_reason="length", seed=4,
        prompt_tokens=1, completion_tokens=1, resumed_tokens=1,
    )  # fmt: skip
    relay.deliver(
        "l-2",
        [
            RelayEvent(id=moved.id, kind="started"),
            RelayEvent(id=moved.id, kind="token", token=6, text="b", finish_reason="length"),
            RelayEvent(id=moved.id, kind="done", completion=completion),
            RelayEvent(id="r1", kind="token", token=9),  # the lost replica's: dropped
        ],
    )
    assert rest.result(timeout=2) == [Event(6, "b", "length")]
    usage = generation.result().usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.resumed_tokens) == (1, 2, 1)


def test_a_replica_silent_for_lost_s_loses_its_requests_and_an_ended_output_is_not_resumed_whole(
    loop, caller
):
    now = [0.0]
    relay = Relay(clock=lambda: now[0])
    poll(loop, relay, "l-1", 0).result(timeout=2)
    submitted = caller.submit(relay.submit, "d-1", request(1), SamplingParams(seed=4), {"l-1"})
    time.sleep(0.1)
    poll(loop, relay, "l-1", 0).result(timeout=2)
    relay.deliver("l-1", [RelayEvent(id="r1", kind="started")])
    generation = submitted.result(timeout=2)
    relay.deliver("l-1", [RelayEvent(id="r1", kind="token", token=5, text="a", finish_reason="stop")])
    reading = caller.submit(list, generation)
    poll(loop, relay, "l-2", 0).result(timeout=2)
    generation.leases = frozenset(LIVE)
    now[0] = LOST_S + 0.1  # l-1 polls no more; l-2 did just now
    poll(loop, relay, "l-2", 0).result(timeout=2)
    time.sleep(1.2)  # the reader looks every CHECK_S
    (moved,) = poll(loop, relay, "l-2", 0).result(timeout=2).requests
    assert moved.resume == []  # its one token ended the output: drawn again, not sent twice
    completion = RelayCompletion(
        prompt=[1], tokens=[5], text="a", finish_reason="stop", seed=4,
        prompt_tokens=1, completion_tokens=1,
    )  # fmt: skip
    relay.deliver(
        "l-2",
        [
            RelayEvent(id=moved.id, kind="started"),
            RelayEvent(id=moved.id, kind="token", token=5, text="a", finish_reason="stop"),
            RelayEvent(id=moved.id, kind="done", completion=completion),
        ],
    )
    assert reading.result(timeout=2) == [Event(5, "a", "stop")]
    assert generation.result().usage.completion_tokens == 1
    assert poll(loop, relay, "l-1", 0).result(timeout=2).cancel == ["r1"]  # should it come back


async def _event() -> asyncio.Event:
    return asyncio.Event()
