"""Whether a prepared dataset fits a job: its tokenizer the model, its tokens the workers and block size.

One rule, checked twice before any money moves: by the CLI at submit (on the manifest it is about to
upload) and by the coordinator (on the uploaded manifest blob), so a refusal reads the same either way.
No torch: the coordinator and the CLI import it.
"""

from __future__ import annotations

from gpuflex.data.assign import check_fits
from gpuflex.data.manifest import BYTE_VOCAB, Manifest
from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import JobSpec, TrainingSpec


def check_job(manifest: Manifest, spec: JobSpec) -> None:
    """BadRequest unless ``spec`` can train on ``manifest``'s tokens: its tokenizer (``check_tokenizer``),
    and enough tokens for every worker's part and the validation split."""
    check_tokenizer(manifest, spec.training)
    check_fits(
        [s.tokens for s in manifest.train],
        [s.tokens for s in manifest.validation],
        spec.resources.workers,
        spec.training.model.block_size,
    )


def check_tokenizer(manifest: Manifest, training: TrainingSpec) -> None:
    """BadRequest unless the model of ``training`` reads ``manifest``'s ids.

    char-gpt is byte-level: it needs a ``bytes`` manifest. hf-causal-lm needs every id to have an
    embedding: a vocabulary of at most the model's (``model.size.vocab``, the config's ``vocab_size``
    the CLI read from ``model.from``; without one, the 256 byte values a model built from the spec's
    shape has).
    """
    tokenizer, recipe = manifest.tokenizer, training.recipe
    size = training.model.size
    model_vocab = size.vocab if size is not None else None
    if recipe == "char-gpt" and tokenizer.kind != "bytes":
        raise BadRequest(
            f"recipe char-gpt is byte-level, and this dataset was tokenized with a tokenizer of "
            f"{tokenizer.vocab_size} ids: prepare it with --bytes, or train it with recipe hf-causal-lm"
        )
    embeddings = BYTE_VOCAB if model_vocab is None else model_vocab
    if recipe == "hf-causal-lm" and tokenizer.vocab_size > embeddings:
        raise BadRequest(
            f"the dataset's tokenizer has a vocabulary of {tokenizer.vocab_size} ids, more than the model's "
            f"{embeddings} embeddings: prepare the data with the model's own tokenizer"
        )
