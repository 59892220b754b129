import pytest
import torch

from gpuflex.data.fit import check_text
from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import JobSpec, parse_job_spec
from gpuflex.train.data import ByteDataset, round_generator, sample_batch, validation_batches


def test_last_tenth_is_validation(corpus):
    ds = ByteDataset(corpus, block_size=32)
    assert len(ds.val) == len(corpus) // 10
    assert bytes(ds.train.tolist()) + bytes(ds.val.tolist()) == corpus


def test_shards_are_contiguous_disjoint_slices_of_train(corpus):
    ds = ByteDataset(corpus, block_size=32)
    shards = [ds.shard(i, 3) for i in range(3)]
    size = len(ds.train) // 3
    assert [len(s) for s in shards] == [size] * 3
    assert torch.equal(torch.cat(shards), ds.train[: 3 * size])


def test_bad_shard_index_and_too_small_shards_are_bad_requests(corpus):
    ds = ByteDataset(corpus, block_size=32)
    with pytest.raises(BadRequest, match="worker_index"):
        ds.shard(3, 3)
    with pytest.raises(BadRequest, match="too few for block_size"):
        ds.shard(0, len(corpus) // 20)
    with pytest.raises(BadRequest, match="validation split"):
        ByteDataset(corpus[:300], block_size=32)
    with pytest.raises(BadRequest, match="empty"):
        ByteDataset(b"", block_size=32)


def test_a_corpus_gpuflex_submit_passes_is_one_it_trains_on_and_the_next_it_refuses_too():
    """``data.fit.check_text`` is what submit checks a corpus by, before it is uploaded."""
    corpus, spec = b"x" * 10_000, _text_job(workers=9, block_size=999)
    check_text(len(corpus), spec)
    data = ByteDataset(corpus, block_size=999)
    windows = [validation_batches(data.val, 1, 1, 999), *(data.shard(i, 9) for i in range(9))]
    assert len(windows) == 10
    with pytest.raises(BadRequest, match="validation split"):
        check_text(len(corpus), _text_job(workers=1, block_size=1000))
    with pytest.raises(BadRequest, match="validation split"):
        ByteDataset(corpus, block_size=1000)


def _text_job(workers: int, block_size: int) -> JobSpec:
    return parse_job_spec(
        {
            "name": "t",
            "resources": {"workers": workers},
            "training": {"model": {"block_size": block_size}},
            "data": {"source": "./text"},
        }
    )


def test_batches_are_reproducible_per_seed_worker_and_round(corpus):
    shard = ByteDataset(corpus, 32).shard(0, 2)

    def batch(seed, worker, round):
        return sample_batch(shard, 4, 32, round_generator(seed, worker, round))[0]

    assert torch.equal(batch(0, 0, 0), batch(0, 0, 0))
    for other in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        assert not torch.equal(batch(0, 0, 0), batch(*other)), other


def test_targets_are_the_next_bytes(corpus):
    tokens = ByteDataset(corpus, 32).train
    x, y = sample_batch(tokens, 6, 32, round_generator(0, 0, 0))
    assert x.shape == y.shape == (6, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y, strict=True):
        window = bytes(row_x.tolist()) + bytes([row_y[-1].item()])
        assert window in corpus


def test_validation_batches_are_fixed_and_span_the_split(corpus):
    val = ByteDataset(corpus, 32).val
    a = validation_batches(val, 3, 4, 32)
    b = validation_batches(val, 3, 4, 32)
    assert len(a) == 3
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert torch.equal(a[0][0][0], val[:32].long())  # first window at the start
    assert torch.equal(a[-1][1][-1], val[-32:].long())  # last window's targets end at the end
