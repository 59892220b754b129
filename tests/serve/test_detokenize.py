"""Streamed text: whole characters only, a stop string never sent, the same state after the same tokens;
what is streamed is what the whole output decodes to, for any tokens a model may draw."""

from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.serve.detokenize import REPLACEMENT, TextStream
from gpuflex.testing import train_bpe

TEXT = "naïve café 😀 alpha beta. gamma delta"
# trained on with few merges, it makes tokens that end or begin inside a character: "!" and the first bytes
# of "👋", the last byte of "ö" and "dé", the last of "字" and "符"
VOCAB = 330
MULTIBYTE = (
    "Hello!👋 Hello! 👋 naïve café, 日本語のテキスト, déjà vu 😀😃🎉 ünïcödé Ωμέγα — “quotes” 中文字符 한국어"
)
ALPHABET = "ab !.,-éüñçΩ—“日本語中文字한국😀👋🎉"


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


@pytest.fixture(scope="module")
def multibyte():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe([MULTIBYTE] * 30, VOCAB), eos_token="<|endoftext|>"
    )


def test_the_multibyte_tokenizer_splits_characters_across_tokens(multibyte):
    ids = multibyte(MULTIBYTE)["input_ids"]
    pieces = [multibyte.decode([i]) for i in ids]
    assert {"!" + REPLACEMENT, REPLACEMENT + "dé"} <= set(pieces)  # a whole character and a part


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_streamed_text_is_the_whole_decode_and_sends_no_replacement_character(multibyte, text):
    ids = multibyte(text)["input_ids"]
    _, deltas = stream_all(multibyte, ids)
    assert "".join(deltas) == multibyte.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas), deltas


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=30),
    stop=st.lists(st.text(alphabet="ab é本😀!" + REPLACEMENT, min_size=1, max_size=3), max_size=2),
)
def test_any_drawn_tokens_stream_as_their_whole_decode_ends(multibyte, ids, stop):
    """A model may draw tokens that are no valid UTF-8 (the first bytes of "👋", then "ows"): the stream
    carries U+FFFD where the whole output's decode has it, and nowhere else (a delta is never taken back)."""
    stream, deltas = stream_all(multibyte, ids, stop=tuple(stop))
    whole = decoder(multibyte)(ids)
    ends = [i for s in stop if (i := whole.find(s)) >= 0]
    assert "".join(deltas) == stream.output == whole[: min(ends, default=len(whole))]


def test_tokens_that_are_no_utf8_stream_as_the_whole_output_decodes(multibyte):
    """Issue 41's "Hello!\ufffdows": "!" with the first bytes of "👋", then "ows" where the bytes that end
    it belong. No later token can mend such bytes, so the model drew them; the stream holds the part
    while it may still complete, then sends what the whole output's decode shows."""
    bang = next(i for i in range(VOCAB) if multibyte.decode([i]) == "!" + REPLACEMENT)
    hello, ows = multibyte("Hello")["input_ids"], multibyte("ows")["input_ids"]
    _, deltas = stream_all(multibyte, [*hello, bang, *ows])
    assert deltas[len(hello)] == ""  # held: the next token may end the character
    assert "".join(deltas) == multibyte.decode([*hello, bang, *ows]) == "Hello!\ufffdows"
