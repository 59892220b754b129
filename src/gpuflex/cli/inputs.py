"""A job's inputs on this machine — its model directory (``training.model.from``), its data (a prepared
dataset, or a text corpus) and its user recipe file: checked here, then uploaded.

``gpuflex submit`` checks before it carries: ``read_inputs`` checks what this machine can (the data
against the job and the model's vocabulary, ``data.fit``; every shard's hash; the recipe file),
``check_inputs`` has the coordinator apply every rule of its own, without the blobs (``POST
/v1/jobs/check``: the spec, the manifest against the job, the wallet against the budget, privacy), and
only then do ``upload_model`` and ``upload_read`` send what the blob store lacks, with progress.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from gpuflex.cli import keys as data_keys
from gpuflex.cli.data import Prepared, check_prepared, send_prepared, stage_prepared
from gpuflex.client import Client
from gpuflex.errors import BadRequest
from gpuflex.privacy.envelope import BLOB_OVERHEAD
from gpuflex.protocol.spec import JobSpec

console = Console()


@dataclass(frozen=True)
class JobInputs:
    """A job's data and recipe file, read and checked here, not yet uploaded."""

    prepared: Prepared | None = None
    corpus: bytes | None = None  # the text built from ``data.source``
    recipe: bytes | None = None  # ``training.recipe_file``'s


def read_inputs(spec: JobSpec) -> JobInputs:
    """Read the job's data and recipe file and check them here: a prepared dataset (``check_prepared``), or
    the corpus built from ``data.source`` (unless ``none``) against the job (``data.fit.check_text``).
    With ``model.from``, give ``spec`` sized (``model.size``): the data's ids are checked against its
    vocabulary, 256 byte ids assumed without one."""
    from gpuflex.data.fit import check_text
    from gpuflex.train.corpus import build_corpus

    prepared = corpus = recipe = None
    if spec.data.prepared is not None:
        prepared = check_prepared(spec, Path(spec.data.prepared).expanduser())
    elif spec.data.source is not None and spec.data.source != "none":
        corpus = build_corpus(spec.data.source, spec.data.max_bytes, spec.data.extensions)
        check_text(len(corpus), spec)
    if spec.training.recipe_file is not None:
        try:
            recipe = Path(spec.training.recipe_file).read_bytes()
        except OSError as err:
            raise BadRequest(f"cannot read recipe_file {spec.training.recipe_file}: {err.strerror}") from None
    return JobInputs(prepared, corpus, recipe)


def check_inputs(client: Client, spec: JobSpec, inputs: JobInputs, sealed_key: str | None = None) -> None:
    """Have the coordinator refuse now what it would refuse of the job once its blobs are uploaded: the
    job's rules, its wallet, a prepared dataset's manifest (staged: ``stage_prepared``). Nothing large is
    uploaded; ``spec`` need only be sized."""
    dataset = recipe_code = None
    if inputs.prepared is not None:
        dataset = stage_prepared(client, inputs.prepared, sealed=sealed_key is not None)
    elif inputs.corpus is not None:
        dataset = hashlib.sha256(inputs.corpus).hexdigest()
    if inputs.recipe is not None:
        recipe_code = hashlib.sha256(inputs.recipe).hexdigest()
    client.check_submit(spec, dataset=dataset, recipe_code=recipe_code, sealed_key=sealed_key)


def upload_read(
    client: Client, inputs: JobInputs, seal: Callable[[bytes], bytes] | None = None
) -> dict[str, str | None]:
    """Upload the job's data — a prepared dataset's shards the blob store lacks and its manifest, or its
    corpus — and its user recipe file, from this machine, each through ``seal`` (``privacy.encrypt``:
    under the job's data key); returns the ``dataset`` and ``recipe_code`` hashes to submit with."""

    def upload(data: bytes) -> str:
        return client.upload(seal(data) if seal is not None else data)

    dataset = None
    if inputs.prepared is not None:
        up = send_prepared(client, inputs.prepared, seal)
        sent = _uploaded(up.sent, up.shards, "shards", f"{up.sent_bytes:,} bytes")
        console.print(f"dataset {up.manifest}: {sent}", highlight=False)
        dataset = up.manifest
    elif inputs.corpus is not None:
        dataset = upload(inputs.corpus)
    recipe_code = None if inputs.recipe is None else upload(inputs.recipe)
    return {"dataset": dataset, "recipe_code": recipe_code}


def upload_inputs(
    client: Client, spec: JobSpec, seal: Callable[[bytes], bytes] | None = None
) -> dict[str, str | None]:
    """Read, check and upload the job's data and recipe file at once (``read_inputs``, ``upload_read``):
    for a job whose model, if any, is uploaded already."""
    inputs = read_inputs(spec)
    if inputs.prepared is not None:
        stage_prepared(client, inputs.prepared, sealed=seal is not None)
    return upload_read(client, inputs, seal)


def upload_model(client: Client, spec: JobSpec, key: data_keys.JobKey | None = None) -> JobSpec:
    """With ``training.model.from``: check and size the model directory here (``train.pretrained``), upload
    what the blob store lacks of it (files cut into parts at the store's blob limit, one part in memory at
    a time), and return the spec naming it (``model.size``, ``model.uploaded``; ``from`` made absolute, for
    ``job fetch --format hf``). Without it, ``spec`` as it is.

    With ``key`` (``privacy.encrypt``) every part and the manifest go up encrypted under it, all of them
    (fresh ciphertexts are in no store yet): the coordinator then holds the consumer's word for the size
    (counted here, as always) and the manifest's ciphertext, never a file's bytes or name (the
    directory's own path stays in the spec: `job fetch --format hf` looks for the base there)."""
    if spec.training.model.from_ is None:
        return spec
    from gpuflex.protocol.spec import UploadedModel
    from gpuflex.train.pretrained import bundle_model, with_model

    root = Path(spec.training.model.from_).expanduser().resolve()
    training = with_model(spec.training, from_=str(root))
    limit = client.missing_blobs([]).max_blob_bytes
    part_bytes = limit if key is None else limit - BLOB_OVERHEAD  # a sealed part still fits the limit
    training, bundle, parts = bundle_model(root, training, part_bytes)
    if key is None:
        missing = set(client.missing_blobs([p.sha256 for p in parts]).keys)
        sent = 0
        for part in parts:
            if part.sha256 in missing:
                client.upload(part.read())
                sent += part.size
        client.upload(bundle.to_bytes())
        stored = _uploaded(len(missing), len(parts), "blobs", f"{sent / 1e6:.1f} MB")
    else:
        sealed = {part.sha256: client.upload(key.seal(part.read())) for part in parts}
        manifest = client.upload(key.seal(bundle.stored_as(sealed).to_bytes()))
        plain_digest = key.digest(bundle.to_bytes())
        uploaded = UploadedModel(manifest=manifest, part_bytes=part_bytes, plain_digest=plain_digest)
        training = with_model(training, uploaded=uploaded)
        megabytes = sum(p.size for p in parts) / 1e6
        stored = f"encrypted here and uploaded as {len(parts)} blobs ({megabytes:.1f} MB)"
    size = training.model.size
    assert size is not None, "bundle_model sizes the model"
    trained = f" ({size.trainable:,} trained)" if size.trainable < size.parameters else ""
    console.print(
        f"model {root}: {size.parameters:,} parameters{trained}, {len(bundle.files)} files; {stored}",
        highlight=False,
    )
    return spec.model_copy(update={"training": training})


def _uploaded(sent: int, total: int, what: str, size: str) -> str:
    """What an upload of ``total`` blobs sent, ``size`` in all: every one, some (the others were stored
    already), or none."""
    if sent == total:
        return f"uploaded {total} {what} ({size})"
    if sent == 0:
        return f"all {total} {what} already stored, none uploaded"
    return f"uploaded {sent} of {total} {what} ({size}), the other {total - sent} already stored"
