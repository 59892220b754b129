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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.storage.bundles import CONFIG, WEIGHTS
from gpuflex.train.outer import load_model
from gpuflex.train.recipes import build_model, get_recipe

# what save_pretrained writes of a model: the export writes its own; everything else (tokenizer) is copied
MODEL_FILES = (CONFIG, "generation_config.json")
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
    dtype = _saved_dtype(base)
    if dtype is not None and (merge or training.lora is None):  # an adapter stays as peft writes it
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
