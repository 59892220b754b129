"""The inner optimizer: AdamW, or Muon for the hidden layers' weight matrices and AdamW for the rest.

``training.inner_optimizer`` picks it. Muon (``torch.optim.Muon``) orthogonalises each 2-D update, which
suits a hidden layer's weight matrix and nothing else: embeddings, the output head, norms and biases stay
with AdamW (MuLoCo, arXiv:2505.23725, puts Muon inside DiLoCo this way). Muon scales its step with
``adjust_lr_fn="match_rms_adamw"`` so its update's RMS matches AdamW's: one ``lr`` and one
``weight_decay`` mean the same for both, and the schedule (``schedule.set_lr``) moves every group of
both at once.

Either way ``inner_optimizer`` returns an ``InnerOptimizer``: its parts stepped, zeroed, scheduled and
traced as one, with ``state`` keyed by parameter as a single optimizer's is. So the trace hashes the
Muon momentum of a hidden matrix where it hashes AdamW's moments of the others (``STATE_KEYS``), and an
audit restores either into the part that owns the parameter.

The output head is the model's last 2-D parameter, aliases included (``named_parameters`` with
duplicates): the built-in recipes and Hugging Face models register it last, and one tied to the token
embedding is that embedding. A user recipe whose model does otherwise trains its head with Muon.
LoRA jobs keep AdamW (``TrainingSpec`` refuses ``muon`` with ``lora``): the adapters are factors of a
low-rank update, and orthogonalising each factor's step does not orthogonalise the weight's.

``training.optimizer_states: 8bit`` takes bitsandbytes' ``AdamW8bit`` for AdamW: its moments blockwise
quantized to 8 bits (2 bytes a parameter instead of 8; tensors under 4,096 values keep fp32 moments, as
bitsandbytes decides). Its state is plain tensors (codes, block maxima, the code map) and an integer step,
so the trace hashes it and an audit restores it like AdamW's: a re-run on the worker's hardware class
reproduces it bit for bit (``tests/train/test_optimizers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.trainable import trainable

# what each part keeps per parameter, and so what a trace covers and an audit state may hold
STATE_KEYS: dict[str, tuple[str, ...]] = {
    "AdamW": ("exp_avg", "exp_avg_sq", "step"),
    "Muon": ("momentum_buffer",),
    "AdamW8bit": ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2", "step"),
}
BLOCK_STATE = ("absmax1", "absmax2", "qmap1", "qmap2")  # AdamW8bit's: shaped by its blocks, not the parameter


class _States(Mapping[Tensor, dict[str, Any]]):
    """The parts' ``state`` as one mapping: ``states[p]`` is the owning part's entry for ``p``."""

    def __init__(self, parts: tuple[torch.optim.Optimizer, ...], owner: dict[int, torch.optim.Optimizer]):
        self.parts = parts
        self.owner = owner

    def __getitem__(self, p: Tensor) -> dict[str, Any]:
        if id(p) not in self.owner:
            raise KeyError(p)
        return self.owner[id(p)].state[p]

    def __iter__(self) -> Iterator[Tensor]:
        return (p for part in self.parts for p in part.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class InnerOptimizer:
    """Optimizers over disjoint parameters, used as one: ``step``, ``zero_grad``, ``param_groups`` (what
    the schedule sets and fp16's ``GradScaler`` unscales) and ``state``."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = parts
        self._owner = {id(p): part for part in parts for group in part.param_groups for p in group["params"]}
        self.state = _States(parts, self._owner)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_keys(self, p: Tensor) -> tuple[str, ...]:
        """What the part that owns ``p`` keeps for it (none for a parameter it does not hold)."""
        part = self._owner.get(id(p))
        return STATE_KEYS[type(part).__name__] if part is not None else ()

    def block_state(self, p: Tensor) -> tuple[str, ...]:
        """The keys of ``p``'s state whose shape is not ``p``'s."""
        return tuple(k for k in self.state_keys(p) if k in BLOCK_STATE)

    def restored(self, p: Tensor, key: str, value: Tensor) -> Tensor | int:
        """``value`` as ``p``'s state ``key`` is kept: on its device, but the step count where the optimizer
        keeps it (AdamW: a CPU tensor, bitsandbytes: an int)."""
        if key != "step":
            return value.to(p.device, copy=True)
        if type(self._owner.get(id(p))).__name__ == "AdamW8bit":
            return int(value)
        return value.to("cpu", copy=True)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable 2-D weights that are neither an embedding's nor the output head (see above)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    matrices = [p for _, p in model.named_parameters(remove_duplicate=False) if p.ndim == 2]
    head = id(matrices[-1]) if matrices else None
    return [p for p in trainable(model).values() if p.ndim == 2 and id(p) not in embeddings | {head}]


def inner_optimizer(model: nn.Module, spec: TrainingSpec) -> InnerOptimizer:
    """A worker's inner optimizer (and an auditor's re-run's) over the trainable parameters."""
    params = list(trainable(model).values())
    muon = hidden_matrices(model) if spec.inner_optimizer == "muon" else []
    taken = {id(p) for p in muon}
    rest = [p for p in params if id(p) not in taken]
    adamw = _adamw(spec)(rest, lr=spec.lr, weight_decay=spec.weight_decay)
    if not muon:
        return InnerOptimizer(adamw)
    hidden = torch.optim.Muon(
        muon, lr=spec.lr, weight_decay=spec.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    return InnerOptimizer(hidden, adamw)


def _adamw(spec: TrainingSpec) -> type[torch.optim.Optimizer]:
    if spec.optimizer_states != "8bit":
        return torch.optim.AdamW
    try:
        import bitsandbytes
    except ImportError:
        raise BadRequest(
            "training.optimizer_states 8bit needs bitsandbytes on this node: pip install 'gpuflex[quantized]'"
        ) from None
    return bitsandbytes.optim.AdamW8bit
