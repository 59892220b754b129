"""hf-causal-lm: a transformers causal LM, built from a config or loaded from a model directory.

Without ``model.from`` the shape comes from the job's ``model`` section (``architecture``: gpt2 | llama)
and nothing is downloaded. With it, the model is ``AutoModelForCausalLM.from_pretrained`` of the job's
model directory (any architecture transformers builds), which reaches a task as blobs
(``train.pretrained``): a full fine-tune's weights in fp32 (``training.precision`` autocasts the steps),
a LoRA job's frozen base as ``train.placement`` lays it out (the steps' dtype, or quantized with
``training.quantize_base``). ``training.lora`` wraps it in peft LoRA adapters, in fp32: the base freezes
and only the adapters train and travel (``train.trainable``); ``training.gradient_checkpointing``
recomputes activations in backward. The loss computes the output head a chunk of tokens at a time
(``train.lm_loss``), never the whole batch's logits.

The data is char-gpt's byte windows of the job's text, ids 0-255, so a model's vocabulary must hold
256 ids; token shards in the model's own vocabulary are ``data.prepared``'s (``gpuflex.data``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import LoraSpec, TrainingSpec
from gpuflex.train.data import VOCAB_SIZE
from gpuflex.train.lm_loss import chunked_cross_entropy
from gpuflex.train.placement import load_options, one_kernel
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


def build_pretrained(spec: TrainingSpec, model_dir: Path, device: torch.device) -> nn.Module:
    """The model of a ``save_pretrained`` directory, laid out for ``device`` (``train.placement``): then
    LoRA and checkpointing."""
    options = load_options(spec, device)
    model = one_kernel(_transformers().AutoModelForCausalLM.from_pretrained(model_dir, **options))
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
    head = _plain_head(model)
    if head is None:
        return next_byte_loss(model(input_ids=inputs).logits, targets)
    # the last hidden states (after the final norm), and the head's logits at one position only
    out = model(input_ids=inputs, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    # ``head.weight`` read now: a sharded model's root forward gathered it, and FSDP2 keeps the root's
    # weights gathered until the backward, which reduce-scatters their gradients
    return chunked_cross_entropy(out.hidden_states[-1], head, targets)


def _plain_head(model: nn.Module) -> nn.Linear | None:
    """The output head when the loss may call it itself: a plain linear layer of a model no data-parallel
    wrapper needs to see called (DDP syncs gradients in its own forward; FSDP2's sharding is the model's
    own, ``train/sharding.py``)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    return head if type(head) is nn.Linear else None  # not an adapter


RECIPE = Recipe(
    name="hf-causal-lm",
    build_model=build,
    build_data=byte_data,
    loss=_loss,
    build_pretrained=build_pretrained,
)
