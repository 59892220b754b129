"""A job's checkpoint as a Hugging Face model directory: what ``gpuflex job fetch --format hf`` and
``gpuflex train local --output-hf`` write.

The checkpoint holds the trained parameters (``trainable.py``): every weight of a full fine-tune, the
adapters of a LoRA one. The model is rebuilt over the job's base directory (the consumer's ``model.from``,
checked to be the very files the job was uploaded from), the checkpoint loaded into it, and then:

- a full fine-tune: ``save_pretrained`` of the whole model (config.json, model.safetensors), in the dtype
  the base directory's weights were saved in (training holds them in fp32: a bf16 base exports as bf16);
- LoRA: the adapter (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``PeftModel.from_pretrained(base, DIR)`` loads, and ``AutoModelForCausalLM.from_pretrained(DIR)`` too
  (the adapter names the base directory by its absolute path); with ``merge``, the adapters merged into
  the base weights and saved as a whole model, in the base's dtype as a full fine-tune is.

The base directory's tokenizer files go along, so ``AutoTokenizer.from_pretrained(DIR)`` loads as well.

``whole_model`` turns such an adapter back into a whole model directory (the adapter merged into the base
it names, as ``merge`` would have written it): what ``gpuflex serve`` and ``gpuflex deploy --model`` take.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.storage.bundles import CONFIG, WEIGHTS
from gpuflex.train.outer import load_model
from gpuflex.train.recipes import build_model, get_recipe
from gpuflex.train.recipes.hf_causal_lm import _peft, _transformers

# what save_pretrained writes of a model: the export writes its own; everything else (tokenizer) is copied
MODEL_FILES = (CONFIG, "generation_config.json")
ADAPTER_CONFIG = "adapter_config.json"
SAVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_hf(
    checkpoint: bytes, training: TrainingSpec, base: Path, out: Path, *, merge: bool = False
) -> Path:
    """Write ``checkpoint`` of a job of ``training`` over the base directory ``base`` into ``out``."""
    if training.model.from_ is None:
        raise BadRequest("only a job with training.model.from exports as a Hugging Face directory")
    if merge and training.lora is None:
        raise BadRequest("--merge merges LoRA adapters, and the job trained every weight")
    base = base.resolve()
    plain = training.model_copy(update={"gradient_checkpointing": False})  # a training-time switch
    model = build_model(plain, get_recipe(training.recipe).from_directory(base))
    load_model(model, checkpoint)
    if merge:
        model = model.merge_and_unload()
    return _save(model, base, out, cast=merge or training.lora is None)  # an adapter stays as peft writes it


def is_adapter(directory: Path) -> bool:
    """Whether ``directory`` is a LoRA adapter (else a whole model); neither is one line saying what to give,
    told before anything is read, merged or sent."""
    if (directory / ADAPTER_CONFIG).is_file():
        return True
    if not (directory / CONFIG).is_file():
        raise BadRequest(
            f"{directory} holds no {CONFIG}: give a save_pretrained model directory or a LoRA adapter "
            "(gpuflex job fetch JOB --format hf -o DIR)"
        )
    return False


@contextmanager
def whole_model(directory: Path) -> Iterator[Path]:
    """``directory`` as a whole model directory for the ``with`` block: itself, or, for a LoRA adapter
    (``adapter_config.json``), the adapter merged into the base directory it names, written to a temporary
    directory of the same name. A base not on this machine is one line naming what works instead."""
    if not is_adapter(directory):
        yield directory
        return
    config = directory / ADAPTER_CONFIG
    named = json.loads(config.read_text()).get("base_model_name_or_path")
    base = Path(named).expanduser() if named else None
    if base is None or not (base / CONFIG).is_file():
        raise BadRequest(
            f"{directory} is a LoRA adapter over {named or 'a base it does not name'}, which is not a model "
            "directory on this machine: fetch its job as a whole model "
            "(gpuflex job fetch JOB --format hf --merge -o DIR), or deploy the job (gpuflex deploy JOB)"
        )
    model = _transformers().AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, local_files_only=True
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours to answer
        warnings.simplefilter("ignore", FutureWarning)
        try:
            merged = _peft().PeftModel.from_pretrained(model, directory).merge_and_unload()
        except (RuntimeError, ValueError) as err:  # another model's adapter: its shapes or modules differ
            reason = str(err).strip().splitlines()[-1].strip()
            raise BadRequest(
                f"{directory} is a LoRA adapter that does not fit its base {base}: {reason}"
            ) from None
    with tempfile.TemporaryDirectory() as tmp:
        yield _save(merged, base.resolve(), Path(tmp) / directory.resolve().name, cast=True)


def _save(model: torch.nn.Module, base: Path, out: Path, *, cast: bool) -> Path:
    """``save_pretrained`` of ``model`` into ``out`` (with ``cast``, in the dtype of the base directory's
    weights), and the base's other files (its tokenizer) beside it."""
    dtype = _saved_dtype(base)
    if cast and dtype is not None:
        model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in sorted(base.iterdir()):
        if (
            f.is_file()
            and f.name not in MODEL_FILES
            and not f.name.endswith(WEIGHTS)
            and not f.name.startswith(".")
        ):
            shutil.copy2(f, out / f.name)
    return out


def _saved_dtype(base: Path) -> torch.dtype | None:
    """The dtype config.json says the base's weights are in (``torch_dtype`` before transformers 5)."""
    config = json.loads((base / CONFIG).read_text())
    return SAVED_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))
