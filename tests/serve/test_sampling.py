"""Sampling settings are checked field by field; each draw depends only on (seed, position) and the
logits, follows the softmax at the temperature within the nucleus, and its gap says how near a miss was."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.serve.sampling import SamplingParams, choose, gaps, nucleus


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("stop", ("",)),
        ("seed", -1),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(field, value):
    with pytest.raises(BadRequest, match=field):
        SamplingParams(**{field: value})


def test_stop_takes_one_string_or_several():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_without_a_seed_one_is_drawn_and_kept():
    drawn = SamplingParams().seeded()
    assert drawn.seed is not None
    assert drawn.seeded() is drawn
    assert SamplingParams(seed=7).seeded().seed == 7


def test_greedy_takes_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert {choose(logits, SamplingParams(temperature=0), i) for i in range(20)} == {1}


def test_a_draw_depends_on_seed_and_position_only():
    logits = torch.zeros(50)
    params = SamplingParams(seed=3)
    forward = [choose(logits, params, i) for i in range(40)]
    backward = [choose(logits, params, i) for i in reversed(range(40))][::-1]
    assert forward == backward  # no state carried from one draw to the next: a resumed run draws the same
    assert len(set(forward)) > 10  # positions draw independently
    assert forward != [choose(logits, SamplingParams(seed=4), i) for i in range(40)]


def test_draws_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, seed=1)
    n = 3000
    counts = Counter(choose(logits, params, i) for i in range(n))
    expected = torch.softmax(logits / 0.5, dim=0)
    for token in range(4):
        assert abs(counts[token] / n - float(expected[token])) < 0.03


def test_top_p_draws_only_from_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(top_p=0.7, seed=2)
    assert nucleus(logits, params).tolist() == [True, True, False, False]
    assert {choose(logits, params, i) for i in range(300)} == {0, 1}


def test_the_gap_of_a_token_is_how_far_it_was_from_being_drawn():
    rows = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(3, 1)  # output positions 0, 1, 2
    greedy = SamplingParams(temperature=0)
    assert gaps(rows[:2], greedy, [0, 1], 0.0).tolist() == pytest.approx([0, math.log(0.5 / 0.3)])
    nucleus_only = SamplingParams(top_p=0.7, seed=5)
    # the third token lies 0.1 of mass beyond top_p: outside with a small slack, inside with a large one
    assert gaps(rows, nucleus_only, [3, 2, 2], 0.01).tolist()[:2] == [math.inf, math.inf]
    assert gaps(rows, nucleus_only, [3, 2, 2], 0.2)[1:].max() < math.inf


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(seed=3)]
)
def test_every_drawn_token_has_no_gap_when_a_whole_output_is_replayed_at_once(params):
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    drawn = [choose(logits[i], params, i) for i in range(len(logits))]
    assert gaps(logits, params, drawn, 0.0).tolist() == [0.0] * len(drawn)
    other = [(t + 1) % 300 for t in drawn]
    assert (gaps(logits, params, other, 0.0) > 0).all()


def test_a_token_at_the_nucleuss_edge_never_wins_against_the_claim():
    # the third token's mass before it is 0.8: inside a top_p of 0.805, outside it by 0.01 less
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(200, 1)
    params = SamplingParams(top_p=0.805, seed=4)
    # a provider whose logits left the edge token out draws from the others
    claimed = [choose(logits[i], replace(params, top_p=0.8), i) for i in range(len(logits))]
    edge = [i for i in range(len(logits)) if choose(logits[i], params, i) == 2]
    assert edge  # positions where the verifier's own logits draw the edge token
    assert (gaps(logits, params, claimed, 0.0)[edge] > 0).all()
    assert gaps(logits, params, claimed, 0.01).tolist() == [0.0] * len(logits)
