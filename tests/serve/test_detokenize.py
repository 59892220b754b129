"""Streamed text: whole characters only, a stop string never sent, the same state after the same tokens."""

from __future__ import annotations

import pytest
import transformers

from gpuflex.serve.detokenize import REPLACEMENT, TextStream
from gpuflex.testing import train_bpe

TEXT = "naïve café 😀 alpha beta. gamma delta"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(["alpha beta gamma delta. " * 20], 280), eos_token="<|endoftext|>"
    )


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def stream_all(tokenizer, ids, stop=()) -> tuple[TextStream, list[str]]:
    stream = TextStream(decoder(tokenizer), stop)
    deltas = [stream.push(token) for token in ids]
    return stream, [*deltas, stream.finish()]


def test_multibyte_characters_are_sent_whole(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT.split())  # the emoji and accents are byte tokens, split across several
    _, deltas = stream_all(tokenizer, ids)
    assert "".join(deltas) == TEXT
    assert not any(REPLACEMENT in d for d in deltas)


def test_the_text_ends_before_a_stop_string_and_never_sends_part_of_it(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    stream, deltas = stream_all(tokenizer, ids, stop=("never there", ". gam"))
    assert stream.stopped
    assert "".join(deltas) == stream.output == "naïve café 😀 alpha beta"
    assert not any("." in d for d in deltas)


def test_text_held_for_a_stop_string_that_never_comes_is_sent_at_the_end(tokenizer):
    ids = tokenizer("alpha beta gam")["input_ids"]
    stream, deltas = stream_all(tokenizer, ids, stop=("gamma ray",))
    assert not stream.stopped
    assert deltas[-1].endswith("gam")  # held back until the output ended
    assert "".join(deltas) == "alpha beta gam"


def test_a_stream_fed_the_sent_tokens_continues_where_the_first_left_off(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    _, whole = stream_all(tokenizer, ids, stop=("delta",))
    for k in range(1, len(ids)):
        resumed = TextStream(decoder(tokenizer), ("delta",))
        resumed.feed(ids[:k])
        rest = [resumed.push(token) for token in ids[k:]]
        assert "".join(whole[:k]) + "".join(rest) + resumed.finish() == "".join(whole)
        assert resumed.output == "".join(whole)
