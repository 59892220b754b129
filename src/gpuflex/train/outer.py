"""The global replica: the global model and the outer optimizer, held identically by every replica.

The aggregator and every worker keep one. A round's aggregated update (the decoded, compressed
mean pseudo-gradient) is applied by each of them with the same outer step, so what crosses the
wire per round is the small update, not the model; ``state_hash`` proves the replicas agree. The
full state (weights and outer momentum, with JSON metadata) is a safetensors blob fetched only to
join, to resync after a hash mismatch, or as the job's checkpoint::

    replica = GlobalReplica(build_model(spec), spec)
    replica.apply(update)                      # θ ← outer_step(θ, Δ̄): SGD, Nesterov momentum
    assert replica.state_hash() == published   # else: replica.load(checkpoint) and catch up
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.checkpoint import load_tensors, save_tensors
from gpuflex.train.commitment import params_hash
from gpuflex.train.compression import Compressor
from gpuflex.train.trainable import load_trained_state, trainable, trained_state

MODEL_PREFIX = "model."
MOMENTUM_PREFIX = "outer_momentum."


class GlobalReplica:
    """θ_global and the outer optimizer's state, at round ``round``."""

    def __init__(self, model: nn.Module, spec: TrainingSpec):
        self.model = model
        self.round = -1
        momentum = spec.outer_momentum
        self.outer = torch.optim.SGD(
            trainable(model).values(), lr=spec.outer_lr, momentum=momentum, nesterov=momentum > 0
        )

    def parameters(self) -> dict[str, Tensor]:
        """The trainable parameters (``trainable.py``): what rounds exchange and hashes cover."""
        return dict(trainable(self.model))

    def decoder(self, compressor: Compressor) -> Callable[[bytes], dict[str, Tensor]]:
        """Decode blobs from the network into this model's shapes only (a hostile header can't
        make the decoder allocate more than the model)."""
        return functools.partial(
            compressor.decompress, shapes={n: p.shape for n, p in self.parameters().items()}
        )

    def apply(self, update: dict[str, Tensor]) -> None:
        """One outer step with ``update`` as the gradient: the same on every replica, bit for bit."""
        params = self.parameters()
        if update.keys() != params.keys():
            raise BadRequest("the update's tensors are not the model's parameters")
        for name, p in params.items():
            p.grad = update[name].to(device=p.device, dtype=p.dtype).reshape(p.shape)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.round += 1

    def state_hash(self) -> str:
        """sha256 over the parameters' bytes in name order: equal iff the replicas agree exactly."""
        return params_hash(self.parameters())

    def to_bytes(self, **metadata: object) -> bytes:
        """The full state as safetensors (of the model: all but its frozen parameters); ``metadata``
        (round, tokens, losses ...) is stored as JSON."""
        tensors = {MODEL_PREFIX + k: v for k, v in trained_state(self.model).items()}
        for name, p in self.parameters().items():
            buffer = self.outer.state.get(p, {}).get("momentum_buffer")
            if buffer is not None:
                tensors[MOMENTUM_PREFIX + name] = buffer
        return save_tensors(tensors, {"gpuflex": json.dumps({"round": self.round, **metadata})})

    def load(self, data: bytes) -> dict:
        """Become the state in ``data`` (from ``to_bytes``); returns its metadata."""
        state, momentum, metadata = _unpack(data)
        _load_state(self.model, state)
        self.outer.state.clear()
        for name, p in self.parameters().items():
            if name in momentum:
                self.outer.state[p] = {"momentum_buffer": momentum[name].to(p.device).clone()}
        self.round = int(metadata.get("round", -1))
        return metadata


def weighted_mean(contributions: list[tuple[int, dict[str, Tensor]]]) -> dict[str, Tensor]:
    """The token-weighted mean of the deltas, in the given order (each once if nobody reported tokens)."""
    weights = [float(t) for t, _ in contributions]
    if sum(weights) == 0:
        weights = [1.0] * len(contributions)
    total = sum(weights)
    names = contributions[0][1].keys()
    return {
        name: sum(w / total * delta[name] for w, (_, delta) in zip(weights, contributions, strict=True))
        for name in names
    }


def load_model(model: nn.Module, checkpoint: bytes) -> dict:
    """Load a job's checkpoint (a ``GlobalReplica`` state) into ``model``; returns its metadata."""
    state, _, metadata = _unpack(checkpoint)
    _load_state(model, state)
    return metadata


def _unpack(data: bytes) -> tuple[dict[str, Tensor], dict[str, Tensor], dict]:
    tensors, header = load_tensors(data)
    try:
        metadata = json.loads(header["gpuflex"])
    except (KeyError, ValueError):
        raise BadRequest("not a GPUFlex checkpoint: its metadata is missing") from None
    model = {k.removeprefix(MODEL_PREFIX): v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    momentum = {
        k.removeprefix(MOMENTUM_PREFIX): v for k, v in tensors.items() if k.startswith(MOMENTUM_PREFIX)
    }
    return model, momentum, metadata


def _load_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    load_trained_state(model, state)
