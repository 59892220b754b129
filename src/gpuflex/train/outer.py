"""The global replica: the global model's trained parameters and the outer optimizer, held identically by
every replica.

The aggregator and every worker keep one. A round's aggregated update (the decoded, compressed
mean pseudo-gradient) is applied by each of them with the same outer step, so what crosses the
wire per round is the small update, not the model; ``state_hash`` proves the replicas agree. The
full state (weights and outer momentum, with JSON metadata) is a safetensors blob fetched only to
join, to resync after a hash mismatch, or as the job's checkpoint::

    replica = GlobalReplica(model, spec)       # a host copy of the model's trained parameters
    replica.apply(update)                      # θ ← outer_step(θ, Δ̄): SGD, Nesterov momentum
    assert replica.state_hash() == published   # else: replica.load(checkpoint) and catch up
    replica.write_to(model)                    # the global weights into a model, to train or evaluate

It holds the trained parameters only (a LoRA job's adapters; the frozen base lives once, in the model),
in host memory (``placement.host``: pinned where CUDA is), with the outer momentum beside them: DiLoCo's
outer state never takes the accelerator's memory, as OpenDiLoCo and INTELLECT-1 keep theirs.
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
from gpuflex.train.placement import host
from gpuflex.train.trainable import frozen_names, load_trained_state, trainable

MODEL_PREFIX = "model."
MOMENTUM_PREFIX = "outer_momentum."


class GlobalReplica:
    """θ_global (the trained parameters, in host memory) and the outer optimizer's state, at ``round``."""

    def __init__(self, model: nn.Module, spec: TrainingSpec):
        self.round = -1
        trained = trainable(model)
        canonical = {id(p): n for n, p in trained.items()}
        self.params = {n: host(p) for n, p in trained.items()}
        # a checkpoint names a trained tensor under each of its state-dict names (a tied head too), and
        # holds the model's other non-frozen entries (buffers), which never change
        self.aliases = {
            n: canonical[id(p)]
            for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) in canonical
        }
        frozen = frozen_names(model)
        self.buffers = {
            k: host(v) for k, v in model.state_dict().items() if k not in frozen and k not in self.aliases
        }
        momentum = spec.outer_momentum
        self.outer = torch.optim.SGD(
            self.params.values(), lr=spec.outer_lr, momentum=momentum, nesterov=momentum > 0
        )

    def parameters(self) -> dict[str, Tensor]:
        """The trained parameters (``trainable.py``): what rounds exchange and hashes cover."""
        return self.params

    def write_to(self, model: nn.Module) -> None:
        """Copy the global weights into ``model``'s trained parameters (wherever they live)."""
        with torch.no_grad():
            for name, p in trainable(model).items():
                p.copy_(self.params[name], non_blocking=True)

    def decoder(self, compressor: Compressor) -> Callable[[bytes], dict[str, Tensor]]:
        """Decode blobs from the network into this model's shapes only (a hostile header can't
        make the decoder allocate more than the model)."""
        return functools.partial(compressor.decompress, shapes={n: p.shape for n, p in self.params.items()})

    def apply(self, update: dict[str, Tensor]) -> None:
        """One outer step with ``update`` as the gradient: the same on every replica, bit for bit."""
        if update.keys() != self.params.keys():
            raise BadRequest("the update's tensors are not the model's parameters")
        for name, p in self.params.items():
            p.grad = update[name].to(device=p.device, dtype=p.dtype).reshape(p.shape)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.round += 1

    def state_hash(self) -> str:
        """sha256 over the parameters' bytes in name order: equal iff the replicas agree exactly."""
        return params_hash(self.params)

    def to_bytes(self, **metadata: object) -> bytes:
        """The full state as safetensors (of the model: all but its frozen parameters); ``metadata``
        (round, tokens, losses ...) is stored as JSON."""
        tensors = {MODEL_PREFIX + k: self.params[n] for k, n in self.aliases.items()}
        tensors |= {MODEL_PREFIX + k: v for k, v in self.buffers.items()}
        for name, p in self.params.items():
            buffer = self.outer.state.get(p, {}).get("momentum_buffer")
            if buffer is not None:
                tensors[MOMENTUM_PREFIX + name] = buffer
        return save_tensors(tensors, {"gpuflex": json.dumps({"round": self.round, **metadata})})

    def load(self, data: bytes) -> dict:
        """Become the state in ``data`` (from ``to_bytes``); returns its metadata."""
        state, momentum, metadata = _unpack(data)
        expected = self.aliases.keys() | self.buffers.keys()
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise BadRequest(
                "the checkpoint does not fit the model: "
                f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
            )
        with torch.no_grad():
            for key, tensor in state.items():
                target = self.params[self.aliases[key]] if key in self.aliases else self.buffers[key]
                if tensor.shape != target.shape:
                    raise BadRequest(
                        f"the checkpoint does not fit the model: {key} has shape {list(tensor.shape)}, "
                        f"expected {list(target.shape)}"
                    )
                target.copy_(tensor)
        self.outer.state.clear()
        for name, p in self.params.items():
            if name in momentum:
                self.outer.state[p] = {"momentum_buffer": host(momentum[name])}
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
    load_trained_state(model, state)
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
