"""Whether a job's data fits it: its tokenizer the model, its tokens the workers and block size.

One rule, checked before anything large is uploaded and again before any money moves: by the CLI at
submit (on the manifest, or the text corpus, it is about to upload) and by the coordinator (on the
manifest blob: asked before the upload, ``POST /v1/jobs/check``, and at submit), so a refusal reads the
same either way. No torch: the coordinator and the CLI import it.
"""

from __future__ import annotations

from gpuflex.data.assign import check_fits
from gpuflex.data.manifest import BYTE_TOKENIZER, BYTE_VOCAB, Manifest, TokenizerInfo
from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import JobSpec, TrainingSpec

TEXT_VAL_FRACTION = 0.1  # a text corpus's last tenth is its validation split
BYTE_RECIPES = ("char-gpt", "hf-causal-lm")  # the recipes that read a text corpus as byte windows


def text_split(corpus_bytes: int) -> tuple[int, int]:
    """The train and validation lengths of a text corpus (``data.source``: an id per byte)."""
    validation = int(corpus_bytes * TEXT_VAL_FRACTION)
    return corpus_bytes - validation, validation


def check_text(corpus_bytes: int, spec: JobSpec) -> None:
    """BadRequest unless ``spec`` can train on a text corpus of ``corpus_bytes`` bytes: byte ids the model
    embeds, and enough of them for every worker's part and the validation split. Only the recipes that
    read a corpus as byte windows (char-gpt, hf-causal-lm) are held to it: a user recipe reads its own."""
    if spec.training.recipe not in BYTE_RECIPES:
        return
    check_tokenizer(BYTE_TOKENIZER, spec.training)
    train, validation = text_split(corpus_bytes)
    more = "give more text (data.source, data.max_bytes): its last tenth is the validation split"
    check_fits([train], [validation], spec.resources.workers, spec.training.model.block_size, more)


def check_job(manifest: Manifest, spec: JobSpec) -> None:
    """BadRequest unless ``spec`` can train on ``manifest``'s tokens: its tokenizer (``check_tokenizer``),
    and enough tokens for every worker's part and the validation split."""
    check_tokenizer(manifest.tokenizer, spec.training)
    check_fits(
        [s.tokens for s in manifest.train],
        [s.tokens for s in manifest.validation],
        spec.resources.workers,
        spec.training.model.block_size,
    )


def check_tokenizer(tokenizer: TokenizerInfo, training: TrainingSpec) -> None:
    """BadRequest unless the model of ``training`` reads the ids ``tokenizer`` made.

    char-gpt is byte-level: it needs a ``bytes`` manifest. hf-causal-lm needs every id to have an
    embedding: a vocabulary of at most the model's (``model.size.vocab``, the config's ``vocab_size``
    the CLI read from ``model.from``; without one, the 256 byte values a model built from the spec's
    shape has).
    """
    recipe = training.recipe
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
