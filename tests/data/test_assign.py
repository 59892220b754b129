"""Assignment and batches: every train token to exactly one worker, and batches reproducible from a seed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuflex.data.assign import Span, assign, batches, validation_batches, worker_tokens
from gpuflex.errors import BadRequest
from gpuflex.train import data as byte_data


@settings(max_examples=200, deadline=None)
@given(shards=st.lists(st.integers(1, 50), min_size=1, max_size=12), workers=st.integers(1, 16))
def test_every_train_token_goes_to_exactly_one_worker_in_stream_order(shards, workers):
    if sum(shards) < workers:
        with pytest.raises(BadRequest, match="cannot be split among"):
            assign(shards, 0, workers)
        return
    parts = [assign(shards, w, workers) for w in range(workers)]
    assert all(parts), "a worker without tokens"
    offsets = np.cumsum([0, *shards])
    covered = [offsets[s.shard] + t for part in parts for s in part for t in range(s.start, s.stop)]
    assert covered == list(range(sum(shards)))
    if len(shards) >= workers:  # whole shards: a worker downloads only its own
        assert all(s.start == 0 and s.stop == shards[s.shard] for part in parts for s in part)


def test_fewer_shards_than_workers_share_them_by_token_ranges():
    assert [assign([10, 5], w, 3) for w in range(3)] == [
        [Span(0, 0, 5)],
        [Span(0, 5, 10)],
        [Span(1, 0, 5)],
    ]
    assert assign([10, 10, 10, 10, 10], 1, 2) == [Span(2, 0, 10), Span(3, 0, 10), Span(4, 0, 10)]


def test_on_one_span_batches_are_the_byte_datasets_own():
    tokens = torch.randint(256, (500,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    ours = batches([tokens.numpy().astype("<u2")], 4, 16, byte_data.round_generator(7, 1, 3))
    theirs = byte_data.round_generator(7, 1, 3)
    for x, y in itertools.islice(ours, 5):
        expected_x, expected_y = byte_data.sample_batch(tokens, 4, 16, theirs)
        assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
        assert x.dtype == y.dtype == torch.int64
    ours_val = validation_batches([tokens.numpy()], 3, 4, 16)
    for (x, y), (ex, ey) in zip(ours_val, byte_data.validation_batches(tokens, 3, 4, 16), strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_batches_are_reproducible_and_never_cross_from_one_span_into_the_next():
    train = [np.arange(s, s + n, dtype="<u2") for s, n in ((0, 40), (100, 40), (200, 7), (300, 40))]
    parts = worker_tokens(train, 1, 2)  # shards 2 and 3: the 7-token one holds no window of 9
    assert [p[0] for p in parts] == [200, 300]

    def draw(seed):
        return list(itertools.islice(batches(parts, 8, 8, torch.Generator().manual_seed(seed)), 4))

    first = draw(5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, draw(5), strict=True))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, draw(6), strict=True))
    for x, y in first:
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], 1):  # one window, all of it in shard 3
            assert row.tolist() == list(range(row[0], row[0] + 9)) and 300 <= row[0] <= 331
    with pytest.raises(BadRequest, match="hold no window of block_size"):
        next(batches(parts, 1, 40, torch.Generator()))
