"""A job's model directory (``training.model.from``): checked and sized on the consumer's machine, written
out from its blobs on a provider.

The CLI uploads the directory as a ``storage.bundles.Bundle`` (every file, large ones in parts) and names
the manifest's hash in ``model.uploaded``, and what the market sizes the job by in ``model.size``
(``describe``: counted on the meta device, so no weight is read). A task writes the files into a
temporary directory of its own (``model_directory``, under the sandbox's work dir) and the recipe loads
it with ``from_pretrained``. On an agent the files come through the node's shard cache, keyed by hash
and linked into that directory, so a node fetches a base model once for all its jobs and tasks; the
directory goes when the task ends, the cached files stay.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from gpuflex.data.cache import ShardCache
from gpuflex.data.fetch import cached
from gpuflex.errors import BadRequest, Conflict
from gpuflex.privacy.envelope import keyed_digest
from gpuflex.protocol.spec import ModelSize, TrainingSpec, UploadedModel
from gpuflex.storage.bundles import (
    Bundle,
    Part,
    bundle_directory,
    file_parts,
    materialize,
    model_problem,
    write_file,
)
from gpuflex.train.checkpoint import sha256
from gpuflex.train.recipes.hf_causal_lm import _transformers, with_lora
from gpuflex.train.trainable import trainable


def check_directory(root: Path) -> None:
    """Refuse, in one line naming it, a path that is not a model directory that travels."""
    if not root.is_dir():
        raise BadRequest(f"training.model.from: {root} is not a directory")
    problem = model_problem(sorted(p.name for p in root.iterdir() if p.is_file()))
    if problem:
        raise BadRequest(f"training.model.from: {root} {problem}")


def describe(root: Path, training: TrainingSpec) -> ModelSize:
    """Check ``root`` and build its model (with the spec's LoRA) on the meta device: its parameter count,
    how many of them train, its depth and width. An architecture transformers cannot build, or a LoRA
    target that names no module, is one line naming it."""
    check_directory(root)
    t = _transformers()
    try:
        config = t.AutoConfig.from_pretrained(root)
    except (ValueError, KeyError, OSError) as err:
        raise BadRequest(f"training.model.from: {root}/config.json: {_first_line(err)}") from None
    try:
        with torch.device("meta"):
            model = t.AutoModelForCausalLM.from_config(config)
            if training.lora is not None:
                model = with_lora(model, training.lora)
    except ValueError as err:
        names = ", ".join(getattr(config, "architectures", None) or []) or "none named"
        raise BadRequest(
            f"training.model.from: transformers cannot build {root}'s architecture as a causal LM "
            f"(model_type {config.model_type!r}, architectures: {names}): {_first_line(err)}"
        ) from None
    return ModelSize(
        parameters=sum(p.numel() for p in model.parameters()),  # each tied tensor once
        trainable=sum(p.numel() for p in trainable(model).values()),
        layers=_first(config, ("num_hidden_layers", "n_layer", "num_layers"), 1),
        hidden=_first(config, ("hidden_size", "n_embd", "d_model"), 1),
        vocab=getattr(config, "vocab_size", None),
        embeddings=_embeddings(model),
        kv_width=_kv_width(config),
        dtype=_DTYPES.get(str(getattr(config, "dtype", None) or "").removeprefix("torch.")),
    )


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _embeddings(model: torch.nn.Module) -> int:
    """Parameters of the token embeddings and the output head, a tied pair once."""
    tables = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    return sum(w.numel() for w in tables.values())


def _kv_width(config: object) -> int | None:
    """A layer's keys per token (grouped-query attention's fewer heads counted): its KV cache's width."""
    hidden = _first(config, ("hidden_size", "n_embd", "d_model"), 0)
    heads = _first(config, ("num_attention_heads", "n_head"), 0)
    if not hidden or not heads:
        return None
    head_dim = _first(config, ("head_dim",), hidden // heads)
    return _first(config, ("num_key_value_heads",), heads) * head_dim


def _first(config: object, names: tuple[str, ...], default: int) -> int:
    return next((int(v) for n in names if isinstance(v := getattr(config, n, None), int)), default)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def bundle_model(
    root: Path, training: TrainingSpec, part_bytes: int
) -> tuple[TrainingSpec, Bundle, list[Part]]:
    """Check and size ``root`` (``describe``), cut it into blobs of at most ``part_bytes``: the spec with
    ``model.uploaded`` set, the manifest, and where each part lies (to upload, one at a time)."""
    size = describe(root, training)
    bundle, parts = bundle_directory(root, part_bytes)
    uploaded = UploadedModel(manifest=sha256(bundle.to_bytes()), part_bytes=part_bytes)
    return with_model(training, size=size, uploaded=uploaded), bundle, parts


def sized(training: TrainingSpec) -> TrainingSpec:
    """``training`` with ``model.size`` counted from ``model.from`` (unchanged without one)."""
    if training.model.from_ is None:
        return training
    return with_model(training, size=describe(Path(training.model.from_), training))


def with_model(training: TrainingSpec, **fields: object) -> TrainingSpec:
    return training.model_copy(update={"model": training.model.model_copy(update=fields)})


def same_model(root: Path, uploaded: UploadedModel, data_key: bytes | None = None) -> bool:
    """Whether ``root`` holds exactly the files a job's model was uploaded from (a base to export over);
    an encrypted job's (its manifest stored as ciphertext) checked with its ``data_key``."""
    plain = bundle_directory(root, uploaded.part_bytes)[0].to_bytes()
    if uploaded.plain_digest is None:
        return sha256(plain) == uploaded.manifest
    return data_key is not None and keyed_digest(data_key, plain) == uploaded.plain_digest


@contextmanager
def model_directory(
    training: TrainingSpec,
    fetch: Callable[[str], bytes],
    cache: ShardCache | None = None,
    unseal: Callable[[bytes], bytes] | None = None,
) -> Iterator[Path | None]:
    """The job's model directory in a temporary directory of the task's for as long as the task runs (None
    for a job without one). ``fetch`` gets a blob by hash as the store holds it; ``unseal`` opens an
    encrypted job's (``privacy.encrypt``).

    With the node's ``cache`` the manifest and every file are blobs there, keyed by the file's sha256 and
    pinned while the task runs, and the directory holds symlinks to them: a node fetches a base model once
    for all its jobs, and nothing is copied. A file larger than the cache, or one the cache has no room
    for beside the running jobs' pinned blobs, is written into the directory instead, as it is with no
    cache (``gpuflex train local``: the local hub's blobs). An encrypted job's manifest and parts are
    cached as the ciphertext they are stored as, by its hash, and opened into the task's directory only."""
    uploaded = training.model.uploaded
    if uploaded is None:
        yield None
        return
    opened = fetch if unseal is None else (lambda digest: unseal(fetch(digest)))
    with ExitStack() as pins, tempfile.TemporaryDirectory(prefix="gpuflex-model-") as tmp:
        dest = Path(tmp)
        if cache is None:
            yield materialize(_bundle(opened(uploaded.manifest)), opened, dest)
            return

        def through_cache(digest: str, what: str, chunks: Callable[[], Iterable[bytes]]) -> Path:
            pins.enter_context(cache.pin(digest))
            return cached(cache, digest, what, chunks)

        def stored(digest: str, what: str) -> bytes:
            """A blob as stored, through the cache when it has room for it (an encrypted job's parts)."""
            try:
                return through_cache(digest, what, lambda: [fetch(digest)]).read_bytes()
            except Conflict:  # the running jobs' pinned blobs leave no room for it
                return fetch(digest)

        data = stored(uploaded.manifest, "the model's manifest")
        bundle = _bundle(data if unseal is None else unseal(data))
        if unseal is not None:
            for entry in bundle.files:
                what = f"a part of model file {entry.name}"
                write_file(entry, lambda key, w=what: unseal(stored(key, w)), dest / entry.name)
            yield dest
            return
        for entry in bundle.files:
            target = dest / entry.name  # a plain file name: the manifest's schema says so
            if entry.size <= cache.limit_bytes:
                try:
                    what = f"model file {entry.name}"
                    path = through_cache(entry.sha256, what, lambda e=entry: file_parts(e, fetch))
                except Conflict:  # the running jobs' pinned blobs leave no room for it
                    pass
                else:
                    target.symlink_to(path.absolute())  # the task's cwd is its work dir
                    continue
            write_file(entry, fetch, target)
        yield dest


def _bundle(data: bytes) -> Bundle:
    bundle = Bundle.from_bytes(data)
    problem = model_problem([f.name for f in bundle.files])
    if problem:
        raise BadRequest(f"the job's model directory {problem}")
    return bundle
