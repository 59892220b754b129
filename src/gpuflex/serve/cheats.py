"""Dishonest providers, for the tests and the benchmark: each does less work, or other work, than asked
and claims it did what was asked. ``verify`` must catch every one.

- a smaller model: the served model with its last layers dropped (``drop_layers``);
- a quantized model: weights fake-quantized per row to int8 or int4 (``quantize``);
- another temperature than asked: the engine run with other ``SamplingParams`` (no helper needed);
- tokens the model did not produce (random or other text), with fingerprints computed honestly over
  them by a prefill (``refingerprint``) or copied from another output;
- an altered prompt: the system message dropped (``drop_system``) before encoding.

``SERVING`` names the model cheats a provider's server task plays under ``provider start --adversary``
(testing only): the replica serves the cheaper model and is honest in all else, its fingerprints included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import torch

from gpuflex.serve.fingerprint import prove_all
from gpuflex.serve.model import ServedModel


def drop_layers(served: ServedModel, keep: int) -> ServedModel:
    """The model with only its first ``keep`` decoder layers."""
    model = copy.deepcopy(served.model)
    decoder = model.get_decoder()
    decoder.layers = torch.nn.ModuleList(list(decoder.layers)[:keep])
    model.config.num_hidden_layers = keep
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:keep]
    return replace(served, model=model)


def quantize(served: ServedModel, bits: int) -> ServedModel:
    """The model with every linear layer's weights (not the output head's) rounded to ``bits``-bit
    integers, symmetric, one scale per output row: what an int8 or int4 server computes with."""
    model = copy.deepcopy(served.model)
    head = model.get_output_embeddings()
    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / levels
                w.copy_((w / scale).round().clamp(-levels, levels) * scale)
    return replace(served, model=model)


def refingerprint(served: ServedModel, prompt: list[int], tokens: list[int]) -> tuple[bytes, ...]:
    """The fingerprints an honest engine would send for ``tokens``, made after the fact by one prefill: what
    a provider can send for tokens it did not draw from the model."""
    hidden, _ = served.prefill(list(prompt) + list(tokens))
    return prove_all(hidden[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])


def drop_system(messages: list[dict]) -> list[dict]:
    """The messages without their system message: a shorter prompt, and not the one asked."""
    return [m for m in messages if m["role"] != "system"]


SERVING: dict[str, Callable[[ServedModel], ServedModel]] = {
    "serve-smaller": lambda served: drop_layers(served, max(1, served.model.config.num_hidden_layers // 2)),
    "serve-int8": lambda served: quantize(served, 8),
    "serve-int4": lambda served: quantize(served, 4),
}
