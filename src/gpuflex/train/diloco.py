"""``DiLoCo``: wrap your own PyTorch training loop, the way ``hivemind.Optimizer`` wraps one.

    opt = DiLoCo(model, torch.optim.AdamW(model.parameters()), transport=transport, spec=spec)
    while not opt.finished:
        loss_fn(model, next(batches)).backward()
        opt.step()              # an inner step; every spec.inner_steps-th one also exchanges
        opt.zero_grad()

It joins the job at the newest published round (the model's weights become the global ones), and
every ``inner_steps`` steps sends its compressed pseudo-gradient, waits for the round's aggregated
update, applies it to its global replica and continues from the new global weights. The
aggregator side is ``gpuflex.train.aggregator.aggregate`` (or a job's aggregator task).
``examples/own_training_loop.py`` runs a whole job this way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from gpuflex.protocol.messages import ContributionSubmit, RoundState
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.compression import ErrorFeedback, get_compressor
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.sync import sync
from gpuflex.train.transport import Transport, wait_for_round


class DiLoCo:
    """A drop-in optimizer: ``step`` and ``zero_grad`` as usual; ``finished`` once the job is over."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        transport: Transport,
        spec: TrainingSpec,
        tokens_per_step: int = 1,
        poll_interval_s: float = 0.2,
    ):
        self.model = model
        self.inner = inner_optimizer
        self.transport = transport
        self.spec = spec
        self.tokens_per_step = tokens_per_step
        self.poll_interval_s = poll_interval_s
        compressor = get_compressor(spec.compression)
        self.feedback = ErrorFeedback(compressor, decay=spec.compression.error_decay)
        self.replica = GlobalReplica(copy.deepcopy(model), spec)
        self.decode = self.replica.decoder(compressor)
        self.finished = False
        self.steps = 0
        self.losses: list[float] = []
        self._follow(wait_for_round(transport, -1, poll_interval_s, lambda: False))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, loss: float | None = None) -> None:
        """One inner step; ``loss`` (optional) is reported as the round's train loss."""
        if self.finished:
            return
        self.inner.step()
        self.steps += 1
        if loss is not None:
            self.losses.append(float(loss))
        if self.steps % self.spec.inner_steps == 0:
            self._exchange()

    def _exchange(self) -> None:
        delta = {n: self.start[n] - p.detach() for n, p in self.model.named_parameters()}
        blob = self.feedback.compress(delta)
        submission = ContributionSubmit(
            round=self.round,
            delta=self.transport.put_blob(blob),
            tokens=self.spec.inner_steps * self.tokens_per_step,
            steps=self.spec.inner_steps,
            train_loss=sum(self.losses) / len(self.losses) if self.losses else None,
        )
        self.losses = []
        if not self.transport.submit_contribution(submission):
            self.feedback.revert()  # the round closed without us: nothing of ours was applied
        self._follow(wait_for_round(self.transport, self.round, self.poll_interval_s, lambda: False))

    def _follow(self, state: RoundState | None) -> None:
        """Adopt the global weights of ``state`` (the newest round), or finish."""
        if state is None or state.finished:
            self.finished = True
            return
        sync(self.replica, self.transport, state, self.decode)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.replica.parameters()[name])
        self.start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.round = state.round
