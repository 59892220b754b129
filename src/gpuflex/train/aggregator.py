"""The DiLoCo aggregator: gathers pseudo-gradients, averages them, publishes the compressed update.

One round, as the aggregator sees it::

    wait until contributions(r) >= max(1, live_workers), or round_timeout_s passes with >= 1
    Δ̄ = Σ w_i · Δ_i / Σ w_i                             # over the contributions that decode and fit
    blob, Δ̂ = compress(Δ̄ + residual)                    # the downlink is compressed too (error feedback)
    replica.apply(Δ̂)                                    # the outer step every replica takes
    publish_round(r + 1, update=blob, state_hash, checkpoint every checkpoint_every rounds)

With ``verification.robust`` (the default) a ``Verifier`` judges the round's contributions first:
screening, then an audit of each drawn one whose audit state comes in before the round's timeout (no
state by then: a ``no-show``), re-run here or, with ``verification.peer_segments``, by a peer and
here only where the two disagree (``peer_audit.py``). Every guilty contribution and every finished
audit is reported (``report_verdict``); the guilty are left out, and the rest are averaged by
``robust.robust_mean`` instead of the token-weighted mean. Audits finish before the round is
aggregated, so a guilty contribution is never applied: a late audit state is no answer, and the
worker a no-show.

The weight ``w_i`` is the tokens contribution i trained on this round; in a federated job
(``config.weights``) it is its owner's dataset size in tokens instead, FedAvg's n_k: every owner runs
the same steps, so by round tokens a small owner would count as much as a large one.

With ``privacy.dp`` (a federated job; ``config.dp``) the average is DP-FedAvg's (McMahan et al. 2018):
each decoded contribution is clipped to the bound C again (the worker clipped its delta, but error
feedback may add residual to it), the weighted sum is divided by the weight of *all* the job's owners, not
of those that came this round (a fixed denominator: one owner's absence moves it by its share alone), and
Gaussian noise of standard deviation ``z · C · max_i w_i / Σ_i w_i`` is added to it
(``privacy.dp.mean_noise_std``): the sensitivity of that average is the largest owner's share of the
weight times C, so the noise is calibrated to the largest owner and covers every smaller one. With equal
weights it is ``z · C / n``, the textbook scale. The noise comes from a generator seeded from the operating
system, never from the job's seed (which the consumer knows). The job runs ``config.dp.rounds`` rounds:
fewer than ``training.rounds`` when its target ε allows fewer.

Round 0 is the recipe's seeded model, published as a full checkpoint. A replacement aggregator
loads the newest checkpoint (weights and outer momentum) and replays the updates after it, so it
continues exactly where its predecessor stopped; only the downlink residual is lost with it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from gpuflex.data.fetch import FetchedShards, ShardReader
from gpuflex.errors import BadRequest, Conflict
from gpuflex.privacy.dp import add_noise, mean_noise_std
from gpuflex.privacy.dp import clip as clip_to
from gpuflex.protocol.messages import Contribution, DPTask, RoundPublish, TaskConfig
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train.compression import Compressor, ErrorFeedback, get_compressor
from gpuflex.train.outer import GlobalReplica, weighted_mean
from gpuflex.train.peer_audit import audit_with_peers
from gpuflex.train.pretrained import model_directory
from gpuflex.train.recipes import Batch, Recipe, build_model, evaluate, for_task, shards
from gpuflex.train.robust import flatten, robust_mean, unflatten
from gpuflex.train.secure import SecureAggregator
from gpuflex.train.sync import sync
from gpuflex.train.transport import Transport, as_stored, fetch_verified
from gpuflex.train.verifier import Judged, Verifier

Delta = dict[str, Tensor]


@dataclass
class AggregatorSummary:
    start_round: int  # the round this aggregator started from: 0, or the one it resumed at
    round: int  # the newest round it published (or found published)
    finished: bool = False
    val_losses: dict[int, float | None] = field(default_factory=dict)  # of the rounds it published
    contributions: int = 0  # pseudo-gradients it applied
    convicted: int = 0  # contributions left out by a guilty verdict
    audits: int = 0  # audits finished (no-shows included)
    verification_s: float = 0.0  # compute spent screening and auditing
    bytes_published: int = 0  # update blobs sent to the workers (checkpoints not counted)
    secure_s: float = 0.0  # under secure aggregation: from the round's quorum to its unmasked sum


@dataclass
class _Aggregator:
    spec: TrainingSpec
    transport: Transport
    recipe: Recipe
    model: nn.Module  # evaluated with the replica's weights written into it
    replica: GlobalReplica
    val: list[Batch]
    downlink: ErrorFeedback
    summary: AggregatorSummary
    robust: bool = False  # clipped averaging (with a verifier) rather than the token-weighted mean
    tokens: int = 0
    weights: dict[str, int] | None = None  # a federated job's, by worker task: its owner's tokens
    dp: DPTask | None = None  # privacy.dp: clip again, average over all owners' weight, add noise
    last: int = 0  # the round that ends the job: spec.rounds, or dp.rounds
    noise: torch.Generator | None = None

    def publish(self, round: int, used: list[Contribution], update: bytes | None) -> None:
        """Evaluate the replica and publish it as ``round``, with its update and, when due, its state."""
        self.replica.write_to(self.model)
        val_loss = evaluate(self.recipe, self.model, self.val)
        self.tokens += sum(c.tokens for c in used)
        known = [c for c in used if c.train_loss is not None]
        weight = sum(c.tokens for c in known)
        train_loss = sum(c.train_loss * c.tokens for c in known) / weight if weight else None
        due = round % self.spec.checkpoint_every == 0 or round == self.last
        checkpoint = self.replica.to_bytes(tokens=self.tokens, val_loss=val_loss, train_loss=train_loss)
        publish = RoundPublish(
            round=round,
            state_hash=self.replica.state_hash(),
            val_loss=val_loss,
            train_loss=train_loss,
            update=self.transport.put_blob(update) if update is not None else None,
            checkpoint=self.transport.put_blob(checkpoint) if due else None,
            contributions=len(used),
            tokens=self.tokens,
        )
        self.transport.publish_round(publish)
        self.summary.round = round
        self.summary.val_losses[round] = val_loss
        self.summary.contributions += len(used)
        self.summary.bytes_published += len(update or b"")

    def step(self, mean: Delta) -> bytes:
        """Compress the round's mean for the downlink, and take the outer step with what the workers see."""
        blob, update = self.downlink.compress_with_echo(mean)
        self.replica.apply(update)  # exactly what every worker will decode
        return blob

    def average(self, used: list[tuple[Contribution, Delta]]) -> Delta:
        if not used:  # every contribution was convicted: the model stays where it is
            return {n: torch.zeros_like(p) for n, p in self.replica.parameters().items()}
        if self.dp is not None:
            return self.private_average(used)
        if not self.robust:
            return weighted_mean([(self.weight(c), d) for c, d in used])
        flats = [flatten(d) for _, d in used]
        return unflatten(robust_mean(flats, [float(c.tokens) for c, _ in used]), used[0][1])

    def weight(self, c: Contribution) -> int:
        return c.tokens if self.weights is None else self.weights.get(c.task_id, 0)

    def private_average(self, used: list[tuple[Contribution, Delta]]) -> Delta:
        """DP-FedAvg's noised average: clipped contributions over the fixed weight of every owner."""
        assert self.dp is not None and self.weights, "privacy.dp is a federated job's: it has weights"
        if self.noise is None:
            self.noise = torch.Generator().manual_seed(secrets.randbits(63))
        everyone = [float(w) for w in self.weights.values()]
        return private_mean([(self.weight(c), d) for c, d in used], everyone, self.dp, self.noise)


def private_mean(
    contributions: list[tuple[float, Delta]],
    everyone: list[float],
    dp: DPTask,
    generator: torch.Generator | None = None,
) -> Delta:
    """``Σ w_i clip(Δ_i) / Σ everyone`` plus N(0, (z · C · max(everyone) / Σ everyone)²) on every value:
    ``everyone`` is the weight of each of the job's owners, whether or not it contributed this round."""
    total = sum(everyone)
    clipped = [(w / total, clip_to(d, dp.clip)[0]) for w, d in contributions]
    mean = {n: sum(w * d[n] for w, d in clipped) for n in contributions[0][1]}
    return add_noise(mean, mean_noise_std(dp.clip, dp.noise_multiplier, everyone), generator)


def run_aggregator(
    config: TaskConfig,
    transport: Transport,
    *,
    poll_interval_s: float = 0.2,
    should_stop: Callable[[], bool] = lambda: False,
    reader: ShardReader | None = None,
) -> AggregatorSummary:
    """The aggregator task of a job: its recipe, model directory and data come with the task's config
    (``reader``: see ``run_worker``); it evaluates on the validation split, and its verifier draws each
    worker's batches."""

    def fetch(digest: str) -> bytes:
        return fetch_verified(transport, digest)

    reader = reader or FetchedShards(transport.get_blob)
    stored, unseal = as_stored(transport)
    with model_directory(config.training, stored, reader.cache, unseal) as model_dir:
        recipe, data = for_task(config, fetch, reader, model_dir)
        verifier = None
        if config.training.verification.robust:
            data_for = shards(config, recipe, fetch, reader)
            verifier = Verifier(config.training, recipe, data_for, config.num_workers)
        return aggregate(
            config.training,
            transport,
            recipe,
            data.validation,
            verifier=verifier,
            poll_interval_s=poll_interval_s,
            should_stop=should_stop,
            weights=config.weights,
            dp=config.dp,
            secure_aggregation=config.secure_aggregation,
            job_id=config.job_id,
        )


def aggregate(
    spec: TrainingSpec,
    transport: Transport,
    recipe: Recipe,
    validation: list[Batch],
    *,
    verifier: Verifier | None = None,
    poll_interval_s: float = 0.2,
    should_stop: Callable[[], bool] = lambda: False,
    weights: dict[str, int] | None = None,
    dp: DPTask | None = None,
    secure_aggregation: int | None = None,
    job_id: str = "",
) -> AggregatorSummary:
    """Publish rounds until round ``spec.rounds`` (``dp.rounds`` with DP) is out or ``should_stop``;
    resumes a job under way.

    Without a ``verifier`` every usable contribution is averaged (a trusted group, ``DiLoCo`` users);
    ``weights``: each worker task's weight, instead of its round's tokens (a federated job); ``dp``: the
    average is DP-FedAvg's (the module's doc); ``secure_aggregation``: its threshold, the workers' updates
    come masked and the aggregator unmasks only their sum (``secure.py``; ``job_id`` binds the masks)."""
    if dp is not None and not weights:
        raise Conflict("privacy.dp averages over the owners' weights: a federated job's aggregator has them")
    compressor = get_compressor(spec.compression)
    model = build_model(spec, recipe)
    agg = _Aggregator(
        spec,
        transport,
        recipe,
        model,
        GlobalReplica(model, spec),
        validation,
        ErrorFeedback(compressor, decay=1.0),  # the downlink keeps all it owes: plain error feedback
        AggregatorSummary(start_round=0, round=0),
        robust=verifier is not None,
        weights=weights,
        dp=dp,
        last=spec.rounds if dp is None else dp.rounds,
    )
    if not _start(agg, compressor):
        return agg.summary
    secure = None
    if secure_aggregation is not None:
        assert weights, "secure aggregation is a federated job's: its aggregator has the weights"
        params = {n: p.detach() for n, p in agg.replica.parameters().items()}
        secure = SecureAggregator.start(
            transport, job_id, weights, secure_aggregation, dp, params, spec, poll_interval_s, should_stop
        )
    gather = _Gatherer(transport, compressor, agg.replica.parameters(), poll_interval_s, should_stop, secure)
    for r in range(agg.replica.round, agg.last):
        if secure is not None:
            secure.open(r)
        used = gather.wait(r, spec.round_timeout_s)
        if used is None:
            return agg.summary
        if secure is not None:
            began = time.monotonic()
            if (mean := secure.mean(r, used)) is None:
                return agg.summary
            agg.summary.secure_s += time.monotonic() - began
            agg.publish(r + 1, [c for c, _ in used], agg.step(mean))
            continue
        if verifier is not None and (used := _verify(agg, gather, verifier, r, used)) is None:
            return agg.summary
        agg.publish(r + 1, [c for c, _ in used], agg.step(agg.average(used)))
    agg.summary.finished = True
    return agg.summary


def _verify(
    agg: _Aggregator,
    gather: _Gatherer,
    verifier: Verifier,
    round: int,
    used: list[tuple[Contribution, Delta]],
) -> list[tuple[Contribution, Delta]] | None:
    """Screen and audit the round; report the verdicts; the contributions that stand (None: stopped)."""
    params = {n: p.detach() for n, p in agg.replica.parameters().items()}
    judged = verifier.screen(round, params, agg.replica.state_hash(), used)
    drawn = [j for j in judged if not j.guilty and j.contribution.audit_segment is not None]
    states = gather.audit_states(round, [j.contribution.task_id for j in drawn])
    if states is None:
        return None
    pairs = list(zip(drawn, states, strict=True))
    if not verifier.spec.verification.peer_segments:
        for j, blob in pairs:
            j.verdict = verifier.audit(round, j, blob)
    elif not audit_with_peers(
        verifier,
        agg.transport,
        round,
        judged,
        pairs,
        gather.deadline,
        gather.poll_interval_s,
        gather.should_stop,
    ):
        return None
    agg.summary.audits += len(drawn)
    for j in judged:
        if j.verdict is not None:
            agg.transport.report_verdict(j.verdict)
            agg.transport.log(_describe(j))
    agg.summary.convicted += sum(j.guilty for j in judged)
    agg.summary.verification_s = verifier.compute_s
    return [(j.contribution, j.delta) for j in judged if not j.guilty]


def _describe(j: Judged) -> str:
    v = j.verdict
    assert v is not None, "only judged contributions are described"
    return f"round {v.round}: task {v.task_id} {'guilty' if v.guilty else 'cleared'} ({v.check}): {v.reason}"


def _start(agg: _Aggregator, compressor: Compressor) -> bool:
    """Publish round 0, or catch up with the rounds already published; False if the job is over."""
    latest = agg.transport.latest_round()
    if latest is None:
        agg.replica.round = 0
        agg.publish(0, [], None)
        return True
    if latest.finished:
        agg.summary = AggregatorSummary(start_round=latest.round, round=latest.round, finished=True)
        return False
    sync(agg.replica, agg.transport, latest, agg.replica.decoder(compressor))
    agg.summary = AggregatorSummary(start_round=latest.round, round=latest.round)
    agg.tokens = latest.tokens
    agg.transport.log(f"resuming at round {latest.round} from checkpoint round {latest.checkpoint_round}")
    return True


class _Gatherer:
    """Waits for a round's quorum, decoding each contribution's blob once and skipping unusable ones."""

    def __init__(
        self,
        transport: Transport,
        compressor: Compressor,
        params: Delta,
        poll_interval_s: float,
        should_stop: Callable[[], bool],
        secure: SecureAggregator | None = None,
    ):
        self.transport = transport
        self.secure = secure
        self.compressor = compressor
        self.shapes = {n: p.shape for n, p in params.items()}
        self.poll_interval_s = poll_interval_s
        self.should_stop = should_stop
        self.decoded: dict[str, Delta | np.ndarray | None] = {}  # by blob digest; None: rejected
        self.deadline = 0.0  # of the round being gathered

    def wait(self, round: int, timeout_s: float) -> list[tuple[Contribution, Delta]] | None:
        """The usable contributions of ``round`` once there is a quorum; None if told to stop first.

        Past the deadline one usable contribution is enough. With none, the round waits on as long as some
        worker is live (a slow first round, a replacement on its way); once no worker has been live for
        ``timeout_s`` and nothing usable came, nobody is left to contribute: that is an error, not a wait
        without end."""
        now = time.monotonic()
        deadline = self.deadline = now + timeout_s
        last_live = now
        self.decoded = {}  # the previous round's blobs are no use any more
        while not self.should_stop():
            listing = self.transport.contributions(round)
            # in task order, so the floating-point sum does not depend on the order of arrival
            arrived = sorted(listing.contributions, key=lambda c: c.task_id)
            usable = [(c, d) for c in arrived if (d := self._decode(c)) is not None]
            quorum = max(1, listing.live_workers)
            if self.secure is not None:
                self.secure.tend(round, listing.live_workers)
                quorum = min(quorum, self.secure.expected())
            now = time.monotonic()
            if len(usable) >= quorum or (usable and now >= deadline):
                return usable
            if listing.live_workers > 0:
                last_live = now
            elif now - last_live >= timeout_s:
                raise Conflict(
                    f"round {round}: no worker left to contribute ({len(arrived)} contributions arrived, "
                    f"none usable, and no worker live for {timeout_s:g}s: every worker left or was excluded)"
                )
            time.sleep(self.poll_interval_s)
        return None

    def audit_states(self, round: int, tasks: list[str]) -> list[bytes | None] | None:
        """The audit state blobs of ``tasks``' contributions, each None if not in by the round's deadline;
        None if told to stop first."""
        states: dict[str, str | None] = dict.fromkeys(tasks)
        while tasks:
            if self.should_stop():
                return None
            for c in self.transport.contributions(round).contributions:
                if c.task_id in states and c.audit_state is not None:
                    states[c.task_id] = c.audit_state
            if all(states.values()) or time.monotonic() >= self.deadline:
                break
            time.sleep(self.poll_interval_s)
        return [fetch_verified(self.transport, d) if d else None for d in (states[t] for t in tasks)]

    def _decode(self, c: Contribution) -> Delta | np.ndarray | None:
        """A contribution's delta (under secure aggregation: its masked vector of the current attempt), once
        per blob; None if unusable."""
        if c.delta not in self.decoded:
            try:
                blob = fetch_verified(self.transport, c.delta)
                if self.secure is not None:
                    self.decoded[c.delta] = self.secure.parse(blob)
                else:
                    delta = self.compressor.decompress(blob, shapes=self.shapes)
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
