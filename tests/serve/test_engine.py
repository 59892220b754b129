"""The engine: batching changes no output, a resumed request continues exactly, events stream the text,
requests end on EOS, a stop string or max_tokens, and what cannot be served is refused with why."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from gpuflex.errors import BadRequest
from gpuflex.serve import engine as engine_module
from gpuflex.serve.engine import Cancelled, Engine
from gpuflex.serve.model import FALLBACK_CHAT_TEMPLATE, ServedModel
from gpuflex.serve.sampling import SamplingParams

from .helpers import generate

GREEDY = SamplingParams(temperature=0, max_tokens=40)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=11)


@pytest.fixture(scope="module")
def prompts(served, conversations) -> list[list[int]]:
    return [served.encode_chat(c) for c in conversations[:4]]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_batched_output_equals_unbatched(served, prompts, params):
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths: the batch is left-padded
    each = [replace(params, seed=params.seed and params.seed + i) for i in range(len(prompts))]
    alone = generate(served, prompts, each, batch=1)
    together = generate(served, prompts, each, batch=4)
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.fingerprints for c in together] == [c.fingerprints for c in alone]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_with_the_same_tokens(served, prompts, params):
    with Engine(served) as engine:
        first = engine.submit(prompts[0], params)
        events = list(first)
        whole = first.result()
        sent = 13
        resumed = engine.submit(prompts[0], params, resume=whole.tokens[:sent])
        rest = list(resumed)
    done = resumed.result()
    assert done.tokens == whole.tokens
    assert done.text == whole.text
    assert "".join(e.text for e in events[:sent] + rest) == whole.text  # the text sent before, then the rest
    assert done.fingerprints == whole.fingerprints  # the prefill's hidden states, as decoding had them
    assert (done.usage.resumed_tokens, done.usage.completion_tokens) == (sent, len(whole.tokens) - sent)


def test_events_stream_the_tokens_and_the_text(served, prompts):
    with Engine(served) as engine:
        request = engine.submit(prompts[1], SamplingParams(max_tokens=24))
        events = list(request)
    done = request.result()
    assert [e.token for e in events] == list(done.tokens)
    assert "".join(e.text for e in events) == done.text
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason == done.finish_reason
    assert done.usage.prompt_tokens == len(prompts[1])
    assert done.usage.completion_tokens == len(done.tokens) <= 24


def test_without_a_seed_the_drawn_one_is_reported_and_reproduces(served, prompts):
    first = generate(served, prompts[:1], [SamplingParams(max_tokens=20)], batch=1)[0]
    assert first.params.seed is not None
    again = generate(served, prompts[:1], [first.params], batch=1)[0]
    assert again.tokens == first.tokens


def test_an_output_ends_at_max_tokens_at_a_stop_string_or_at_eos(served, prompts):
    long = generate(served, prompts[2:3], [replace(GREEDY, max_tokens=30)], batch=1)[0]
    assert (long.finish_reason, len(long.tokens)) == ("length", 30)
    stop = long.text[10:14]
    stopped = generate(served, prompts[2:3], [replace(GREEDY, stop=(stop,))], batch=1)[0]
    assert (stopped.finish_reason, stopped.text) == ("stop", long.text[: long.text.index(stop)])
    eos_at_third = replace(served, eos=frozenset({long.tokens[2]}))
    ended = generate(eos_at_third, prompts[2:3], [GREEDY], batch=1)[0]
    assert (ended.finish_reason, ended.tokens) == (
        "stop",
        long.tokens[: long.tokens.index(long.tokens[2]) + 1],
    )


def test_what_cannot_be_served_is_refused_with_why(served, prompts):
    with Engine(served) as engine:
        with pytest.raises(BadRequest, match=f"context of {served.context} tokens"):
            engine.submit(prompts[0], SamplingParams(max_tokens=served.context))
        with pytest.raises(BadRequest, match="vocabulary"):
            engine.submit([10**6], GREEDY)
        with pytest.raises(BadRequest, match="nothing left"):
            engine.submit(prompts[0], replace(GREEDY, max_tokens=2), resume=[5, 6])
        with pytest.raises(BadRequest, match="end-of-sequence"):
            engine.submit(prompts[0], GREEDY, resume=sorted(served.eos))
        with pytest.raises(BadRequest, match="empty"):
            engine.submit([], GREEDY)


def test_chat_messages_go_through_a_fallback_template(served):
    assert not served.tokenizer.chat_template  # the tiny tokenizer has none
    ids = served.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha"}]
    )
    assert served.decode(ids) == "<|system|>\nbe brief\n<|user|>\nalpha\n<|assistant|>\n"
    assert "assistant" in FALLBACK_CHAT_TEMPLATE
    with pytest.raises(BadRequest, match=r"messages\[0\].role"):
        served.encode_chat([{"role": "narrator", "content": "x"}])
    with pytest.raises(BadRequest, match=r"messages\[1\].content"):
        served.encode_chat([{"role": "user", "content": "x"}, {"role": "user", "content": 3}])


def test_a_failed_batch_fails_its_requests_and_the_engine_serves_on(
    served: ServedModel, prompts, monkeypatch
):
    real = engine_module._prefill
    calls = []

    def fails_once(model, batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real(model, batch)

    monkeypatch.setattr(engine_module, "_prefill", fails_once)
    with Engine(served) as engine:
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.submit(prompts[0], GREEDY).result(timeout=60)
        assert engine.submit(prompts[0], GREEDY).result(timeout=60).tokens


def test_a_request_joins_the_batch_under_way_and_its_output_is_what_it_would_be_alone(
    served: ServedModel, prompts, monkeypatch
):
    """Continuous batching: the second request is decoded beside the first rather than after it."""
    params = [replace(GREEDY, max_tokens=30), replace(SAMPLED, max_tokens=8)]
    alone = generate(served, prompts[:2], params, batch=1)
    real, sizes, second_in = engine_module._Running.step, [], threading.Event()

    def step(running):
        sizes.append(running.size)
        real(running)
        second_in.wait(timeout=60)  # the first step waits until the second request is queued

    monkeypatch.setattr(engine_module._Running, "step", step)
    with Engine(served, max_batch=4) as engine:
        first = engine.submit(prompts[0], params[0])
        next(iter(first))  # its first token: the batch is under way, held after its first step
        second = engine.submit(prompts[1], params[1])
        second_in.set()
        together = [first.result(timeout=60), second.result(timeout=60)]
    assert sizes[0] == 1 and 2 in sizes  # it started alone and the second joined it
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert [c.fingerprints for c in together] == [c.fingerprints for c in alone]


def test_a_cancelled_request_stops_and_leaves_the_batch(served, prompts):
    room = served.context - len(prompts[0])
    with Engine(served, max_batch=2) as engine:
        abandoned = engine.submit(prompts[0], replace(GREEDY, max_tokens=room))
        beside = engine.submit(prompts[1], GREEDY)
        next(iter(abandoned))
        abandoned.cancel()
        with pytest.raises(Cancelled):
            abandoned.result(timeout=60)
        assert beside.result(timeout=60).finish_reason in ("stop", "length")  # the other row went on
        after = engine.submit(prompts[2], GREEDY).result(timeout=60)  # a round after the abandoned one's
    assert len(abandoned._tokens) < room  # it stopped: its row left the batch
    alone = generate(served, prompts[2:3], [GREEDY], batch=1)[0]
    assert after.tokens == alone.tokens
    beside_alone = generate(served, prompts[1:2], [GREEDY], batch=1)[0]
    assert beside.result().tokens == beside_alone.tokens
