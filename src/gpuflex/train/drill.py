"""Drills: a job as a direct loop over the runtime's verification pieces, for tests and the benchmark.

No threads, no polling: each round every worker trains from the same global model (``Replica``), the
adversaries among them see the honest deltas of the round (colluders: the strongest case), each delta
goes through its worker's compressor with error feedback (``Replica.seal``), the ``Verifier`` screens
every contribution and audits those the ``draw`` picks (with peer audits, another worker of the drill
re-runs them: the peer's seconds are kept apart), and what stands is averaged by ``robust_mean``
and applied by the outer optimizer. Nobody is excluded, so every contribution is judged (and counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuflex.protocol.messages import Commitment, Contribution, TaskConfig, VerdictSubmit
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.train import adversaries
from gpuflex.train.checkpoint import sha256
from gpuflex.train.outer import GlobalReplica, weighted_mean
from gpuflex.train.peer_audit import delegate, replay, settle
from gpuflex.train.recipes import build_model, evaluate, get_recipe
from gpuflex.train.robust import flatten, robust_mean, unflatten
from gpuflex.train.verifier import Judged, Verifier
from gpuflex.train.worker import Replica, RoundResult, Situation

LATE = "late"  # an honest worker that does half the steps and says so

Draw = Callable[[int, Commitment], int | None]  # (worker, commitment) -> the segment to audit, or None


@dataclass
class Drill:
    """Workers of one job: ``kinds`` holds None (honest), ``LATE``, or an adversary kind for each."""

    spec: TrainingSpec
    corpus: bytes
    kinds: list[str | None]

    def __post_init__(self) -> None:
        self.recipe = get_recipe("char-gpt")
        n = len(self.kinds)
        self.data = [self.recipe.build_data(self.corpus, self.spec, i, n) for i in range(n)]
        self.configs = [
            TaskConfig(
                job_id="j", task_id=f"w{i}", role="worker", worker_index=i, num_workers=n, training=self.spec
            )
            for i in range(n)
        ]
        self.replicas = [Replica(c, self.recipe, d) for c, d in zip(self.configs, self.data, strict=True)]
        self.players = {i: adversaries.get(k) for i, k in enumerate(self.kinds) if k not in (None, LATE)}
        self.model = build_model(self.spec, self.recipe)  # evaluated with the global weights written in
        self.global_ = GlobalReplica(self.model, self.spec)
        self.global_.round = 0
        self.verifier = Verifier(self.spec, self.recipe, self.data.__getitem__, n)
        self.last: dict[int, Commitment | None] = {}  # worker -> its last contribution's commitment
        self.own: dict[int, dict] = {}  # worker -> its last delta, with ``overlap`` where its round begins
        self.before: dict = {}  # the previous round's model
        self.peer_model = build_model(self.spec, self.recipe)  # what peers re-run in
        self.peer_s = 0.0  # peers' re-runs, with peer audits

    def validation_loss(self) -> float | None:
        """The global model's loss on worker 0's validation batches."""
        self.global_.write_to(self.model)
        return evaluate(self.recipe, self.model, self.data[0].validation)

    def _start(self, worker: int, start: dict) -> dict:
        """Where an honest worker begins: the round's model ``start``, or with ``overlap`` the previous
        round's less its own delta there (``worker.py``: it trains on before that round is averaged)."""
        own = self.own.get(worker) if self.spec.overlap else None
        return start if own is None else {n: p - own[n] for n, p in self.before.items()}

    def restart(self, worker: int) -> None:
        """Worker ``worker``'s task goes to a replacement node: fresh optimizer moments and residual."""
        self.replicas[worker] = Replica(self.configs[worker], self.recipe, self.data[worker])

    def round(self, r: int, draw: Draw) -> tuple[list[Judged], dict[int, RoundResult]]:
        """Train round ``r``, judge it, apply what stands; the judgements and the workers' results."""
        start = {n: p.detach().clone() for n, p in self.global_.parameters().items()}
        results: dict[int, RoundResult] = {}
        for i, kind in enumerate(self.kinds):
            if i not in self.players:
                steps = self.spec.inner_steps // 2 if kind == LATE else None
                results[i] = self.replicas[i].train_round(
                    self._start(i, start), r, lambda: False, steps=steps
                )
        peers = tuple(res.delta for res in results.values())
        for i, player in self.players.items():
            results[i] = player.play(Situation(self.replicas[i], start, r, lambda: False, peers=peers))
        arrived = []
        for i in range(len(self.kinds)):
            blob, res = self.replicas[i].seal(results[i])
            results[i] = res
            c = Contribution(
                task_id=f"w{i}",
                node_id=f"n{i}",
                delta=sha256(blob),
                tokens=res.steps * 256,
                steps=res.steps,
                train_loss=res.train_loss or None,
                commitment=res.commitment,
                audit_segment=draw(i, res.commitment) if res.commitment is not None else None,
                carried=last.residual_out if (last := self.last.get(i)) else None,
                carried_chain=last.chain if last else None,
            )
            self.last[i] = res.commitment
            self.own[i] = res.delta
            arrived.append((c, self.replicas[i].decode(blob)))
        self.before = start
        if not self.spec.verification.robust:  # as the aggregator: no checks, the token-weighted mean
            self.global_.apply(weighted_mean([(c.tokens, d) for c, d in arrived]))
            return [Judged(c, d) for c, d in arrived], results
        judged = self.verifier.screen(r, start, self.global_.state_hash(), arrived)
        load: dict[str, int] = {}
        for i, j in enumerate(judged):
            segment = j.contribution.audit_segment
            if not j.guilty and segment is not None:
                j.verdict = self._audit(r, j, results[i], segment, judged, load)
        kept = [j for j in judged if not j.guilty]
        if kept:
            mean = robust_mean([flatten(j.delta) for j in kept], [float(j.contribution.tokens) for j in kept])
            self.global_.apply(unflatten(mean, kept[0].delta))
        return judged, results

    def _audit(
        self, r: int, j: Judged, result: RoundResult, segment: int, judged: list[Judged], load: dict[str, int]
    ) -> VerdictSubmit:
        """The core node's audit of the drawn segment; with peer audits, a peer's re-run (its seconds go
        to ``peer_s``; a framer reports what it likes) and the core node's of a dispute
        (``peer_audit.py``)."""
        count = self.spec.verification.peer_segments
        blob = result.audit_state(segment, max(1, count))
        if not count:
            return self.verifier.audit(r, j, blob)
        delegated = delegate(self.verifier, r, j, blob, judged, load)
        if isinstance(delegated, VerdictSubmit):
            return delegated
        began = time.perf_counter()
        hashes = replay(self.spec, self.recipe, delegated.order(), j.batches, model=self.peer_model)
        self.peer_s += time.perf_counter() - began
        peer = self.players.get(int(delegated.peer.contribution.task_id.removeprefix("w")))
        hashes = getattr(peer, "vouch", list)(hashes)  # what the peer reports: a framer changes it
        return settle(self.verifier, r, j, delegated, hashes)
