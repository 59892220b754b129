"""Whether a prepared dataset fits a job: one clear line naming the numbers, at submit and on the server."""

from __future__ import annotations

import pytest

from gpuflex.data.fit import check_job, check_text
from gpuflex.data.manifest import Manifest, Shard, TokenizerInfo
from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import parse_job_spec

BYTES = TokenizerInfo(kind="bytes", hash="bytes", vocab_size=256, eos_id=10)
BPE = TokenizerInfo(kind="hf", hash="a" * 64, vocab_size=300, eos_id=0)


def manifest(train: list[int], validation: list[int], tokenizer: TokenizerInfo = BYTES) -> Manifest:
    def shards(split: str, sizes: list[int]) -> list[Shard]:
        return [Shard(file=f"{split}-{i:05d}.bin", sha256=f"{i:064x}", tokens=n) for i, n in enumerate(sizes)]

    return Manifest(
        tokenizer=tokenizer,
        dtype="uint16",
        shard_tokens=max(train + validation),
        train=shards("train", train),
        validation=shards("validation", validation),
        documents=1,
        tokens=sum(train + validation),
        bytes_read=0,
        sources=[],
    )


def job(recipe: str = "char-gpt", workers: int = 2, block_size: int = 32, model_vocab: int | None = None):
    """A job's spec; ``model_vocab``: of a model directory (``model.from``), as the CLI counted it."""
    model: dict = {"block_size": block_size}
    if model_vocab is not None:
        model |= {"from": "./model", "size": {"parameters": 1, "trainable": 1, "vocab": model_vocab}}
    return parse_job_spec(
        {
            "name": "fit",
            "resources": {"workers": workers},
            "training": {"recipe": recipe, "model": model},
            "data": {"prepared": "./prepared"},
        }
    )


def test_a_dataset_that_fits_passes():
    check_job(manifest([100, 100, 100, 40], [50]), job(workers=4))
    check_job(manifest([100, 100], [50], BYTES), job("hf-causal-lm"))
    check_job(manifest([100, 100], [50], BPE), job("hf-causal-lm", model_vocab=300))


def test_char_gpt_needs_a_bytes_dataset():
    with pytest.raises(BadRequest) as err:
        check_job(manifest([100, 100], [50], BPE), job())
    assert err.value.message == (
        "recipe char-gpt is byte-level, and this dataset was tokenized with a tokenizer of 300 ids: "
        "prepare it with --bytes, or train it with recipe hf-causal-lm"
    )


def test_a_vocabulary_beyond_the_models_embeddings_is_refused():
    with pytest.raises(BadRequest) as err:
        check_job(manifest([100, 100], [50], BPE), job("hf-causal-lm"))
    assert err.value.message == (
        "the dataset's tokenizer has a vocabulary of 300 ids, more than the model's 256 embeddings: "
        "prepare the data with the model's own tokenizer"
    )
    with pytest.raises(BadRequest, match="vocabulary of 300 ids, more than the model's 299 embeddings"):
        check_job(manifest([100, 100], [50], BPE), job("hf-causal-lm", model_vocab=299))


def test_a_dataset_too_small_for_the_workers_is_refused_naming_the_numbers():
    with pytest.raises(BadRequest) as err:
        check_job(manifest([100, 20], [50]), job(workers=2, block_size=32))
    assert err.value.message == (
        "the dataset is too small for 2 workers x block_size 32: worker 1's part is 20 tokens in 1 span(s) "
        "of 120 train tokens in 2 shard(s), and a window is block_size + 1 = 33 tokens within one shard: "
        "prepare more data, or use fewer workers or a smaller block_size"
    )
    with pytest.raises(BadRequest, match=r"validation split \(30 tokens in 1 shard\(s\)\) is too small"):
        check_job(manifest([100, 100], [30]), job(block_size=32))
    with pytest.raises(BadRequest, match="cannot be split among 4 workers"):
        check_job(manifest([2], [50]), job(workers=4, block_size=8))


def text_job(
    recipe: str = "char-gpt", workers: int = 1, block_size: int = 32, model_vocab: int | None = None
):
    """``job`` on text (``data.source``)."""
    spec = job(recipe, workers, block_size, model_vocab).model_dump(by_alias=True, exclude_none=True)
    return parse_job_spec({**spec, "data": {"source": "./text"}})


def test_a_text_corpus_is_checked_by_its_last_tenth_and_each_workers_part_of_the_rest():
    check_text(10_000, text_job(block_size=999))  # 1,000 validation bytes: one window of 1,000
    with pytest.raises(BadRequest) as err:
        check_text(10_000, text_job(block_size=1000))
    assert err.value.message == (
        "the dataset's validation split (1000 tokens in 1 shard(s)) is too small for block_size 1000: a "
        "window is block_size + 1 = 1001 tokens within one shard; give more text (data.source, "
        "data.max_bytes): its last tenth is the validation split"
    )
    check_text(10_000, text_job(workers=9, block_size=999))  # 9,000 train bytes: 1,000 a worker
    with pytest.raises(BadRequest, match="too small for 10 workers x block_size 900: worker 0's part is 900"):
        check_text(10_000, text_job(workers=10, block_size=900))
    spec = text_job(block_size=4096)
    user = spec.model_copy(update={"training": spec.training.model_copy(update={"recipe": "user"})})
    check_text(10_000, user)  # a user recipe reads its corpus its own way


def test_a_text_corpus_needs_a_model_that_embeds_every_byte():
    check_text(10_000, text_job("hf-causal-lm", model_vocab=256))
    with pytest.raises(BadRequest, match="vocabulary of 256 ids, more than the model's 200 embeddings"):
        check_text(10_000, text_job("hf-causal-lm", model_vocab=200))
