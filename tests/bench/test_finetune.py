"""``bench/finetune.py``'s download share: the bytes of the shards a worker opened over the dataset's."""

from __future__ import annotations

import pytest

from gpuflex.data.assign import assign
from gpuflex.data.manifest import read_manifest
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import Source
from gpuflex.data.tokenizer import load_tokenizer

from . import bench_script


@pytest.fixture(scope="module")
def finetune():
    return bench_script("finetune")


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "d.txt").write_text(" ".join(str(i) for i in range(400)))  # 1,490 bytes: 14 train shards
    out = tmp_path / "out"
    prepare(Source([str(tmp_path / "d.txt")]), load_tokenizer(None), out, shard_tokens=100, val_tokens=100)
    return out


def test_a_worker_that_reads_its_own_shards_meets_the_target_and_one_that_reads_all_does_not(
    finetune, prepared
):
    manifest = read_manifest(prepared)
    validation = [s.file for s in manifest.validation]
    own = [
        [
            manifest.train[s.shard].file
            for s in assign([s.tokens for s in manifest.train], i, finetune.WORKERS)
        ]
        + validation
        for i in range(finetune.WORKERS)
    ]
    everything = [s.file for s in manifest.train] + validation
    total = sum((prepared / f).stat().st_size for f in everything)
    largest = max(sum((prepared / f).stat().st_size for f in files) for files in own)

    share = finetune.download_share(prepared, own)
    assert share["train_shards"] == 14 and share["shards_read"] == [4, 5, 4, 5]  # 3 or 4 train + validation
    assert share["worker_download_share"] == pytest.approx(largest / total)
    assert share["validation_share"] == pytest.approx((prepared / validation[0]).stat().st_size / total)
    assert share["worker_download_share"] <= share["worker_download_share_target"]
    assert finetune.download_share(prepared, [everything])["worker_download_share"] == 1.0
