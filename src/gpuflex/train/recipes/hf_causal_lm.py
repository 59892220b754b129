"""hf-causal-lm: a transformers causal LM, built from a config or loaded from a model directory.

Without ``model.from`` the shape comes from the job's ``model`` section (``architecture``: gpt2 | llama)
and nothing is downloaded. With it, the model is ``AutoModelForCausalLM.from_pretrained`` of the job's
model directory (any architecture transformers builds), which reaches a task as blobs
(``train.pretrained``), its weights loaded in fp32 (``training.precision`` autocasts the steps).
``training.lora`` wraps it in peft LoRA adapters: the base freezes and only the adapters train and
travel (``train.trainable``); ``training.gradient_checkpointing`` recomputes activations in backward.

The data is char-gpt's byte windows of the job's text, ids 0-255, so a model's vocabulary must hold
256 ids; token shards in the model's own vocabulary are ``data.prepared``'s (``gpuflex.data``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import LoraSpec, TrainingSpec
from gpuflex.train.data import VOCAB_SIZE
from gpuflex.train.recipes import Batch, Recipe
from gpuflex.train.recipes.char_gpt import byte_data, next_byte_loss

LORA_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)  # what peft puts adapters on


def _transformers():
    try:
        import transformers
    except ImportError:
        raise BadRequest("recipe hf-causal-lm needs transformers: pip install 'gpuflex[recipes]'") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def _peft():
    try:
        import peft
    except ImportError:
        raise BadRequest("training.lora needs peft: pip install 'gpuflex[recipes]'") from None
    return peft


def build(spec: TrainingSpec) -> nn.Module:
    """The model from the job's config (no directory): then LoRA and checkpointing as the spec asks."""
    return finish(spec, _from_config(spec))


def build_pretrained(spec: TrainingSpec, model_dir: Path) -> nn.Module:
    """The model of a ``save_pretrained`` directory, in fp32: then LoRA and checkpointing."""
    # in its saved dtype, then fp32 (exact from bf16 or fp16): the name of from_pretrained's dtype argument
    # changed between transformers releases
    model = _transformers().AutoModelForCausalLM.from_pretrained(model_dir).float()
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < VOCAB_SIZE:
        raise BadRequest(f"the model's vocabulary holds {vocab} ids; the job's byte data needs {VOCAB_SIZE}")
    return finish(spec, model)


def finish(spec: TrainingSpec, model: nn.Module) -> nn.Module:
    """Gradient checkpointing, then LoRA adapters, as the spec asks."""
    if spec.gradient_checkpointing:
        no_reentry = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=no_reentry)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=no_reentry)
        model.config.use_cache = False
    return with_lora(model, spec.lora) if spec.lora is not None else model


def with_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules``; an entry that names no module is refused,
    naming the modules there are (peft itself complains only when no entry matches)."""
    names = adaptable(model)
    unknown = [t for t in lora.target_modules if t not in names]
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise BadRequest(
            f"training.lora.target_modules: {', '.join(unknown)} matches no module of the model; "
            f"its modules: {', '.join(leaves)}"
        )
    peft = _peft()
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours to answer
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def adaptable(model: nn.Module) -> set[str]:
    """Names a LoRA target may use (peft's rule): each adaptable module's full name and every dotted
    suffix of it."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    names: set[str] = set()
    for name, module in model.named_modules():
        if name and isinstance(module, (*LORA_LAYERS, Conv1D)):
            parts = name.split(".")
            names.update(".".join(parts[i:]) for i in range(len(parts)))
    return {n for n in names if not n.isdigit()}


def _from_config(spec: TrainingSpec) -> nn.Module:
    t, m = _transformers(), spec.model
    if m.architecture == "llama":
        config = t.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=m.n_embd,
            intermediate_size=4 * m.n_embd,
            num_hidden_layers=m.n_layer,
            num_attention_heads=m.n_head,
            num_key_value_heads=m.n_head,
            max_position_embeddings=m.block_size,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        return t.LlamaForCausalLM(config)
    config = t.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=m.block_size,
        n_embd=m.n_embd,
        n_layer=m.n_layer,
        n_head=m.n_head,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        bos_token_id=None,
        eos_token_id=None,
    )
    return t.GPT2LMHeadModel(config)


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    inputs, targets = batch
    return next_byte_loss(model(input_ids=inputs).logits, targets)


RECIPE = Recipe(
    name="hf-causal-lm",
    build_model=build,
    build_data=byte_data,
    loss=_loss,
    build_pretrained=build_pretrained,
)
