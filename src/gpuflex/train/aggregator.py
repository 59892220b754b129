"""The DiLoCo aggregator: gathers pseudo-gradients, takes the outer Nesterov step, publishes θ_{r+1}.

One round, as the aggregator sees it::

    wait until contributions(r) >= max(1, live_workers), or round_timeout_s passes with >= 1
    Δ = Σ tokens_i · Δ_i / Σ tokens_i                   # over the contributions that decode and fit
    p.grad = Δ; SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True).step()
    publish_round(r + 1, put_blob(θ_{r+1}), val_loss, train_loss)

Round 0 is the recipe's seeded model. A replacement aggregator resumes from the latest
published round. The outer optimizer's momentum lives in memory only, so a replacement
restarts it from zero; a later issue checkpoints it for failover.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import Contribution, RoundPublish, TaskConfig
from gpuflex.train.checkpoint import load_into, state_to_bytes
from gpuflex.train.compression import Compressor, get_compressor
from gpuflex.train.data import Batch, ByteDataset, validation_batches
from gpuflex.train.recipes import build_model
from gpuflex.train.transport import Transport, fetch_verified

Delta = dict[str, Tensor]


@dataclass
class AggregatorSummary:
    start_round: int  # the round this aggregator started from: 0, or the one it resumed at
    round: int  # the newest round it published (or found published)
    finished: bool = False
    val_losses: dict[int, float] = field(default_factory=dict)  # of the rounds it published
    contributions: int = 0  # pseudo-gradients it applied


def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    """Mean loss of ``model`` over ``batches``."""
    model.eval()
    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in batches) / len(batches)


def run_aggregator(
    config: TaskConfig,
    transport: Transport,
    *,
    poll_interval_s: float = 0.2,
    should_stop: Callable[[], bool] = lambda: False,
) -> AggregatorSummary:
    """Publish rounds until round ``rounds`` is out or ``should_stop``; resumes a job already under way."""
    spec = config.training
    block = spec.model.block_size
    dataset = ByteDataset(fetch_verified(transport, config.dataset), block)
    val = validation_batches(dataset.val, spec.eval_batches, spec.batch_size, block)
    model = build_model(spec)
    summary = _start(model, val, transport)
    if summary.finished:
        return summary
    outer = torch.optim.SGD(model.parameters(), lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=True)
    gather = _Gatherer(transport, get_compressor(spec.compression), model, poll_interval_s, should_stop)
    for r in range(summary.round, spec.rounds):
        used = gather.wait(r, spec.round_timeout_s)
        if used is None:
            return summary
        _outer_step(model, outer, used)
        _publish(model, val, transport, r + 1, [c for c, _ in used], summary)
    summary.finished = True
    return summary


def _start(model: nn.Module, val: list[Batch], transport: Transport) -> AggregatorSummary:
    """Load the latest published model into ``model``, or publish ``model`` as round 0."""
    latest = transport.latest_round()
    if latest is None:
        summary = AggregatorSummary(start_round=0, round=0)
        _publish(model, val, transport, 0, [], summary)
        return summary
    if latest.finished:
        return AggregatorSummary(start_round=latest.round, round=latest.round, finished=True)
    load_into(model, fetch_verified(transport, latest.model))
    transport.log(f"resuming at round {latest.round}; outer momentum restarts from zero")
    return AggregatorSummary(start_round=latest.round, round=latest.round)


def _publish(
    model: nn.Module,
    val: list[Batch],
    transport: Transport,
    round: int,
    used: list[Contribution],
    summary: AggregatorSummary,
) -> None:
    """Evaluate ``model``, upload it and publish it as ``round``, recording it in ``summary``."""
    val_loss = evaluate(model, val)
    known = [c for c in used if c.train_loss is not None]
    tokens = sum(c.tokens for c in known)
    train_loss = sum(c.train_loss * c.tokens for c in known) / tokens if tokens else None
    digest = transport.put_blob(state_to_bytes(model.state_dict()))
    publish = RoundPublish(
        round=round, model=digest, val_loss=val_loss, train_loss=train_loss, contributions=len(used)
    )
    transport.publish_round(publish)
    summary.round = round
    summary.val_losses[round] = val_loss
    summary.contributions += len(used)
    shown = "-" if train_loss is None else f"{train_loss:.4f}"
    transport.log(
        f"published round {round}: {len(used)} contributions, val loss {val_loss:.4f}, train loss {shown}"
    )


def _outer_step(
    model: nn.Module, outer: torch.optim.Optimizer, used: list[tuple[Contribution, Delta]]
) -> None:
    """Treat the token-weighted mean pseudo-gradient as the gradient of one outer SGD step."""
    weights = [float(c.tokens) for c, _ in used]
    if sum(weights) == 0:  # nobody reported tokens: count each contribution once
        weights = [1.0] * len(used)
    total = sum(weights)
    for name, p in model.named_parameters():
        p.grad = sum(w / total * delta[name] for w, (_, delta) in zip(weights, used, strict=True))
    outer.step()
    outer.zero_grad(set_to_none=True)


class _Gatherer:
    """Waits for a round's quorum, decoding each contribution's blob once and skipping unusable ones."""

    def __init__(
        self,
        transport: Transport,
        compressor: Compressor,
        model: nn.Module,
        poll_interval_s: float,
        should_stop: Callable[[], bool],
    ):
        self.transport = transport
        self.compressor = compressor
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.poll_interval_s = poll_interval_s
        self.should_stop = should_stop
        self.decoded: dict[str, Delta | None] = {}  # by blob digest; None: rejected

    def wait(self, round: int, timeout_s: float) -> list[tuple[Contribution, Delta]] | None:
        """The usable contributions of ``round`` once there is a quorum; None if told to stop first."""
        deadline = time.monotonic() + timeout_s
        self.decoded = {}  # the previous round's blobs are no use any more
        while not self.should_stop():
            listing = self.transport.contributions(round)
            # in task order, so the floating-point sum does not depend on the order of arrival
            arrived = sorted(listing.contributions, key=lambda c: c.task_id)
            usable = [(c, d) for c in arrived if (d := self._decode(c)) is not None]
            quorum = max(1, listing.live_workers)
            if len(usable) >= quorum or (usable and time.monotonic() >= deadline):
                return usable
            time.sleep(self.poll_interval_s)
        return None

    def _decode(self, c: Contribution) -> Delta | None:
        if c.delta not in self.decoded:
            try:
                delta = self.compressor.decompress(fetch_verified(self.transport, c.delta))
                _check_fits(delta, self.shapes)
                self.decoded[c.delta] = delta
            except BadRequest as err:
                self.decoded[c.delta] = None
                self.transport.log(f"rejected contribution of task {c.task_id}: {err.message}")
        return self.decoded[c.delta]


def _check_fits(delta: Delta, shapes: dict[str, torch.Size]) -> None:
    if delta.keys() != shapes.keys():
        raise BadRequest("its tensors are not the model's parameters")
    for name, shape in shapes.items():
        if delta[name].shape != shape:
            raise BadRequest(f"{name} has shape {list(delta[name].shape)}, expected {list(shape)}")
        if not torch.isfinite(delta[name]).all():
            raise BadRequest(f"{name} has non-finite values")
