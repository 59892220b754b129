"""Which of a model's parameters a job trains, and so exchanges, commits to and checkpoints.

A full fine-tune trains every parameter; LoRA (``recipes/hf_causal_lm.py``, through peft) freezes the
base weights and trains only the adapters. Everything that travels or is hashed — pseudo-gradients, the
outer optimizer's momentum, a round's ``state_hash``, trace hashes, audit states, checkpoints — covers the
trainable parameters alone (``trainable``), so a LoRA round costs the adapters' bytes, not the model's.
The frozen base comes from the job's model directory, which every node holds already, and never travels
again. A model with nothing frozen is handled exactly as before.
"""

from __future__ import annotations

from torch import Tensor, nn

from gpuflex.errors import BadRequest


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a job trains, by name (``named_parameters`` order)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def frozen_names(model: nn.Module) -> set[str]:
    """State-dict names of frozen parameters, tied aliases included: what a checkpoint leaves out."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(model: nn.Module) -> dict[str, Tensor]:
    """The ``state_dict`` less the frozen parameters: what a checkpoint holds (buffers included)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trained_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load ``trained_state``'s tensors into ``model``; every non-frozen entry must be there and fit."""
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape mismatch
        raise BadRequest(f"the checkpoint does not fit the model: {err}") from None
    missing = set(result.missing_keys) - frozen_names(model)
    if missing or result.unexpected_keys:
        raise BadRequest(
            "the checkpoint does not fit the model: "
            f"missing {sorted(missing)[:4]}, unexpected {sorted(result.unexpected_keys)[:4]}"
        )
