"""A DiLoCo worker: inner AdamW steps on its shard, then a compressed pseudo-gradient upload.

One round, as the worker sees it::

    state = wait for a round newer than the last one contributed to (or the job finished)
    θ_r = load(get_blob(state.model))                 # verified against its hash
    θ_i = θ_r; repeat H times: θ_i = AdamW step on a batch of this worker's shard
    Δ = θ_r - θ_i
    blob = compress(Δ + residual); residual = what compression lost   # error feedback
    submit_contribution(round=r, delta=put_blob(blob), tokens=H·batch·block, ...)

The AdamW state lives across rounds, as in DiLoCo. A contribution refused as stale (the
round closed while this worker trained) is dropped, and so is its error-feedback residual.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpuflex.protocol.messages import ContributionSubmit, RoundState, TaskConfig
from gpuflex.train.checkpoint import load_into
from gpuflex.train.compression import ErrorFeedback, get_compressor
from gpuflex.train.data import ByteDataset, round_generator, sample_batch
from gpuflex.train.recipes import build_model
from gpuflex.train.transport import Transport, fetch_verified, wait_for_round

GRAD_CLIP = 1.0  # max gradient norm of an inner step, as in nanoGPT: keeps early steps from blowing up


@dataclass
class WorkerSummary:
    contributed: list[int] = field(default_factory=list)  # rounds whose contribution was accepted
    stale: list[int] = field(default_factory=list)  # rounds that closed before the contribution arrived
    tokens: int = 0  # tokens trained on in accepted contributions
    bytes_sent: int = 0  # pseudo-gradient bytes uploaded, stale ones included
    finished: bool = False  # the job finished (rather than this worker being told to stop)


@dataclass(frozen=True)
class RoundResult:
    delta: dict[str, Tensor]
    steps: int
    train_loss: float


class Replica:
    """This worker's model, inner optimizer and error feedback: everything kept between rounds."""

    def __init__(self, config: TaskConfig, shard: Tensor):
        self.spec = config.training
        self.worker_index = config.worker_index
        self.shard = shard
        self.model = build_model(self.spec)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.spec.lr, weight_decay=self.spec.weight_decay
        )
        self.feedback = ErrorFeedback(get_compressor(self.spec.compression))

    def train_round(
        self, round: int, model_blob: bytes, should_stop: Callable[[], bool]
    ) -> RoundResult | None:
        """H inner steps from the global model in ``model_blob``; None if told to stop midway."""
        load_into(self.model, model_blob)
        start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        generator = round_generator(self.spec.seed, self.worker_index, round)
        block = self.spec.model.block_size
        self.model.train()
        losses = []
        for _ in range(self.spec.inner_steps):
            if should_stop():
                return None
            inputs, targets = sample_batch(self.shard, self.spec.batch_size, block, generator)
            _, loss = self.model(inputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
            self.optimizer.step()
            losses.append(loss.item())
        delta = {n: start[n] - p.detach() for n, p in self.model.named_parameters()}
        return RoundResult(delta=delta, steps=len(losses), train_loss=sum(losses) / len(losses))


def run_worker(
    config: TaskConfig,
    transport: Transport,
    *,
    poll_interval_s: float = 0.2,
    should_stop: Callable[[], bool] = lambda: False,
) -> WorkerSummary:
    """Contribute to every round from the latest published one until the job finishes or ``should_stop``."""
    spec = config.training
    dataset = ByteDataset(fetch_verified(transport, config.dataset), spec.model.block_size)
    replica = Replica(config, dataset.shard(config.worker_index, config.num_workers))
    summary = WorkerSummary()
    last = -1
    while (state := wait_for_round(transport, last, poll_interval_s, should_stop)) is not None:
        if state.finished:
            summary.finished = True
            break
        if not _contribute(replica, state, transport, summary, should_stop):
            break
        last = state.round
    return summary


def _contribute(
    replica: Replica,
    state: RoundState,
    transport: Transport,
    summary: WorkerSummary,
    should_stop: Callable[[], bool],
) -> bool:
    """Train on round ``state`` and submit; False if told to stop before submitting."""
    began = time.monotonic()
    result = replica.train_round(state.round, fetch_verified(transport, state.model), should_stop)
    if result is None:
        return False
    blob = replica.feedback.compress(result.delta)
    spec = replica.spec
    tokens = result.steps * spec.batch_size * spec.model.block_size
    submission = ContributionSubmit(
        round=state.round,
        delta=transport.put_blob(blob),
        tokens=tokens,
        steps=result.steps,
        train_loss=result.train_loss,
    )
    accepted = transport.submit_contribution(submission)
    summary.bytes_sent += len(blob)
    if accepted:
        summary.contributed.append(state.round)
        summary.tokens += tokens
    else:
        replica.feedback.revert()
        summary.stale.append(state.round)
    transport.log(
        f"round {state.round}: {result.steps} steps, train loss {result.train_loss:.4f}, "
        f"sent {len(blob) / 1e3:.1f} kB ({spec.compression}) in {time.monotonic() - began:.1f}s, "
        + ("accepted" if accepted else "stale: the round had closed")
    )
    return True
