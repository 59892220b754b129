"""``DiLoCo``: wrap your own PyTorch training loop, the way ``hivemind.Optimizer`` wraps one.

    opt = DiLoCo(model, torch.optim.AdamW(model.parameters()), transport=transport, spec=spec)
    while not opt.finished:
        loss_fn(model, next(batches)).backward()
        opt.step()              # an inner step; every spec.inner_steps-th one also exchanges
        opt.zero_grad()

It joins the job at the newest published round (the model's weights become the global ones), and
every ``inner_steps`` steps sends its compressed pseudo-gradient, waits for the round's aggregated
update, applies it to its global replica and continues from the new global weights.

The inner optimizer is any of yours. For the job's own (``training.inner_optimizer``; Muon for the
hidden weight matrices and AdamW for the rest, at one lr, as MuLoCo does), pass
``gpuflex.train.inner_optimizer(model, spec)``; set its lr yourself in your loop, as with any optimizer
(``param_groups`` spans both parts).

``transport`` is a ``Transport`` (the relay: an aggregator, ``gpuflex.train.aggregator.aggregate`` or
a job's aggregator task, averages the round) or a ``CollectiveTransport`` (a trusted
``torch.distributed`` group whose ranks average among themselves). ``examples/own_training_loop.py``
runs a whole job this way.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuflex.protocol.messages import ContributionSubmit
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.collective import CollectiveTransport
from gpuflex.train.compression import ErrorFeedback, get_compressor
from gpuflex.train.optimizers import InnerOptimizer
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.sync import sync
from gpuflex.train.trainable import trainable
from gpuflex.train.transport import Decoder, Exchange, Outgoing, Transport, wait_for_round


class RelayExchange:
    """The default exchange: a ``Transport``'s blob store and round protocol, an aggregator behind them."""

    def __init__(self, transport: Transport, poll_interval_s: float):
        self.transport = transport
        self.poll_interval_s = poll_interval_s

    def join(self, replica: GlobalReplica, decode: Decoder) -> bool:
        return self._follow(replica, -1, decode)

    def exchange(self, replica: GlobalReplica, outgoing: Outgoing, decode: Decoder) -> tuple[bool, bool]:
        submission = ContributionSubmit(
            round=replica.round,
            delta=self.transport.put_blob(outgoing.blob),
            tokens=outgoing.tokens,
            steps=outgoing.steps,
            train_loss=outgoing.train_loss,
        )
        accepted = self.transport.submit_contribution(submission).accepted
        return accepted, self._follow(replica, replica.round, decode)

    def _follow(self, replica: GlobalReplica, newer_than: int, decode: Decoder) -> bool:
        state = wait_for_round(self.transport, newer_than, self.poll_interval_s, lambda: False)
        if state is None or state.finished:
            return False
        sync(replica, self.transport, state, decode)
        return True


class DiLoCo:
    """A drop-in optimizer: ``step`` and ``zero_grad`` as usual; ``finished`` once the job is over."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer | InnerOptimizer,
        *,
        transport: Transport | CollectiveTransport,
        spec: TrainingSpec,
        tokens_per_step: int = 1,
        poll_interval_s: float = 0.2,
    ):
        self.model = model
        self.inner = inner_optimizer
        self.spec = spec
        self.tokens_per_step = tokens_per_step
        self.exchange: Exchange = (
            transport
            if isinstance(transport, CollectiveTransport)
            else RelayExchange(transport, poll_interval_s)
        )
        compressor = get_compressor(spec.compression)
        self.feedback = ErrorFeedback(compressor, decay=spec.compression.error_decay)
        self.replica = GlobalReplica(model, spec)  # the trained parameters, in host memory
        self.decode = self.replica.decoder(compressor)
        self.finished = False
        self.steps = 0
        self.losses: list[float] = []
        self._continue(self.exchange.join(self.replica, self.decode))

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
        delta = {n: self.start[n] - p.detach().cpu() for n, p in trainable(self.model).items()}
        outgoing = Outgoing(
            blob=self.feedback.compress(delta),
            tokens=self.spec.inner_steps * self.tokens_per_step,
            steps=self.spec.inner_steps,
            train_loss=sum(self.losses) / len(self.losses) if self.losses else None,
        )
        self.losses = []
        used, running = self.exchange.exchange(self.replica, outgoing, self.decode)
        if not used:
            self.feedback.revert()  # the round closed without us: nothing of ours was applied
        self._continue(running)

    def _continue(self, running: bool) -> None:
        """Adopt the replica's global weights as the next round's start, or finish."""
        if not running:
            self.finished = True
            return
        self.replica.write_to(self.model)
        self.start = self.replica.parameters()  # unchanged until the next exchange, after the delta
