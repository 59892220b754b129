"""Whole jobs on one LocalTransport: an aggregator and workers in threads, on a tiny model."""

import pytest

from gpuflex.errors import BadRequest, ServiceError
from gpuflex.protocol.messages import ContributionSubmit, RoundPublish
from gpuflex.train.aggregator import run_aggregator
from gpuflex.train.checkpoint import sha256, state_to_bytes
from gpuflex.train.data import ByteDataset
from gpuflex.train.recipes import build_model
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport
from gpuflex.train.worker import Replica, WorkerSummary, _contribute, run_worker

from .helpers import POLL, ThreadedJob, task_config, tiny_spec

TIMEOUT = 60  # seconds a whole job may take before the test calls it hung


def _run_job(corpus: bytes, rounds: int = 3, seed: int = 0) -> tuple[LocalTransport, dict, list[dict]]:
    spec = tiny_spec(rounds=rounds, seed=seed)
    transport = LocalTransport(rounds, live_workers=2)
    dataset = transport.put_blob(corpus)
    with ThreadedJob(transport, spec, dataset) as job:
        workers = [job.start("worker", i) for i in range(2)]
        aggregator = job.start("aggregator").result(timeout=TIMEOUT)
        return transport, aggregator, [w.result(timeout=TIMEOUT) for w in workers]


def test_a_job_trains_and_validation_loss_falls(corpus):
    transport, aggregator, workers = _run_job(corpus)
    history = transport.history()
    assert [p.round for p in history] == [0, 1, 2, 3]
    assert transport.latest_round().finished
    assert history[-1].val_loss < history[0].val_loss - 0.5
    assert [p.contributions for p in history] == [0, 2, 2, 2]  # quorum: both live workers, every round
    assert all(p.train_loss is not None for p in history[1:])
    assert aggregator["role"] == "aggregator" and aggregator["finished"]
    assert aggregator["start_round"] == 0 and aggregator["contributions"] == 6
    spec = tiny_spec()
    for w in workers:
        assert w["finished"] and w["contributed"] == [0, 1, 2] and w["stale"] == []
        assert w["tokens"] == 3 * spec.inner_steps * spec.batch_size * spec.model.block_size
    worker_lines = [m for task, m in transport.logs() if task == "worker-0"]
    assert len(worker_lines) == 3 and "accepted" in worker_lines[0]


def test_a_rerun_reproduces_the_same_models(corpus):
    first, _, _ = _run_job(corpus, rounds=2)
    second, _, _ = _run_job(corpus, rounds=2)
    third, _, _ = _run_job(corpus, rounds=2, seed=1)
    assert [p.model for p in first.history()] == [p.model for p in second.history()]
    assert first.history()[-1].model != third.history()[-1].model


def test_a_resumed_aggregator_continues_from_the_latest_round(corpus):
    spec = tiny_spec(rounds=3)
    transport = LocalTransport(3, live_workers=2)
    dataset = transport.put_blob(corpus)
    config = task_config(spec, dataset, "aggregator")

    def round_one_is_out() -> bool:
        latest = transport.latest_round()
        return latest is not None and latest.round >= 1

    with ThreadedJob(transport, spec, dataset) as job:
        workers = [job.start("worker", i) for i in range(2)]
        first = run_aggregator(config, transport, poll_interval_s=POLL, should_stop=round_one_is_out)
        before = transport.history()
        second = run_aggregator(config, transport.for_task("aggregator-new"), poll_interval_s=POLL)
        results = [w.result(timeout=TIMEOUT) for w in workers]
    assert (first.start_round, first.round, first.finished) == (0, 1, False)
    assert [p.round for p in before] == [0, 1]
    assert (second.start_round, second.round, second.finished) == (1, 3, True)
    assert set(second.val_losses) == {2, 3}  # it published neither round 0 nor round 1 again
    history = transport.history()
    assert history[:2] == before and [p.round for p in history] == [0, 1, 2, 3]
    assert history[2].contributions == 2
    assert ("aggregator-new", "resuming at round 1; outer momentum restarts from zero") in transport.logs()
    assert all(r["contributed"] == [0, 1, 2] for r in results)


def test_an_aggregator_that_finds_the_job_finished_returns_at_once(corpus):
    transport, _, _ = _run_job(corpus, rounds=1)
    spec = tiny_spec(rounds=1)
    summary = run_aggregator(task_config(spec, sha256(corpus), "aggregator"), transport)
    assert summary.finished and summary.start_round == 1 and summary.val_losses == {}
    assert len(transport.history()) == 2


def test_stragglers_are_skipped_after_the_round_timeout(corpus):
    spec = tiny_spec(rounds=2, round_timeout_s=0.2)
    transport = LocalTransport(2, live_workers=2)  # two leases are live, but one worker never shows up
    dataset = transport.put_blob(corpus)
    with ThreadedJob(transport, spec, dataset) as job:
        worker = job.start("worker", 0)
        job.start("aggregator").result(timeout=TIMEOUT)
        assert worker.result(timeout=TIMEOUT)["contributed"] == [0, 1]
    assert [p.contributions for p in transport.history()] == [0, 1, 1]


class _RoundClosesWhileTraining(LocalTransport):
    """Fault injector: the next round is published just before this worker's round-0 upload lands."""

    def submit_contribution(self, c: ContributionSubmit) -> bool:
        if c.round == 0:
            self.publish_round(RoundPublish(round=1, model=self.latest_round().model))
            return super().submit_contribution(c)
        accepted = super().submit_contribution(c)
        self.publish_round(RoundPublish(round=2, model=self.latest_round().model))
        return accepted


def test_a_stale_worker_drops_its_contribution_and_joins_the_next_round(corpus):
    spec = tiny_spec(rounds=2)
    transport = _RoundClosesWhileTraining(2, live_workers=1)
    dataset = transport.put_blob(corpus)
    transport.publish_round(RoundPublish(round=0, model=transport.put_blob(_initial_model(spec))))
    summary = run_worker(task_config(spec, dataset, "worker", 0, 1), transport, poll_interval_s=POLL)
    assert summary.stale == [0] and summary.contributed == [1] and summary.finished
    assert len(transport.contributions(1).contributions) == 1
    assert transport.contributions(0).contributions == []
    assert "stale" in transport.logs()[0][1]


def test_a_stopped_worker_returns_without_contributing(corpus):
    spec = tiny_spec(rounds=2)
    transport = LocalTransport(2, live_workers=1)
    dataset = transport.put_blob(corpus)
    transport.publish_round(RoundPublish(round=0, model=transport.put_blob(_initial_model(spec))))
    steps = iter(range(1000))
    summary = run_worker(
        task_config(spec, dataset, "worker", 0, 1),
        transport,
        poll_interval_s=POLL,
        should_stop=lambda: next(steps) > 3,
    )
    assert summary.contributed == [] and not summary.finished
    assert transport.contributions(0).contributions == []


def _initial_model(spec) -> bytes:
    return state_to_bytes(build_model(spec).state_dict())


def test_run_task_refuses_an_unknown_role():
    config = task_config(tiny_spec(), "0" * 64, "worker").model_copy(update={"role": "referee"})
    with pytest.raises(BadRequest, match="unknown task role 'referee'"):
        run_task(config, LocalTransport(1, 1))


def test_a_stale_contribution_leaves_no_error_feedback_residual(corpus):
    spec = tiny_spec(rounds=2, compression="int8")
    transport = _RoundClosesWhileTraining(2, live_workers=1)
    transport.publish_round(RoundPublish(round=0, model=transport.put_blob(_initial_model(spec))))
    config = task_config(spec, transport.put_blob(corpus), "worker", 0, 1)
    replica = Replica(config, ByteDataset(corpus, 32).shard(0, 1))
    summary = WorkerSummary()
    assert _contribute(replica, transport.latest_round(), transport, summary, lambda: False)
    assert summary.stale == [0]
    assert replica.feedback.residual == {}  # the blob was never applied, so nothing is carried over
    assert _contribute(replica, transport.latest_round(), transport, summary, lambda: False)
    assert summary.contributed == [1]
    assert replica.feedback.residual.keys() == {n for n, _ in replica.model.named_parameters()}
    adam_steps = {state["step"].item() for state in replica.optimizer.state.values()}
    assert adam_steps == {2 * spec.inner_steps}  # the inner optimizer's state carries across rounds


def test_a_worker_refuses_a_corrupted_model_blob(corpus):
    class CorruptModels(LocalTransport):
        def get_blob(self, digest: str) -> bytes:
            data = super().get_blob(digest)
            return data if data == corpus else data[:-1] + bytes([data[-1] ^ 1])

    spec = tiny_spec(rounds=1)
    transport = CorruptModels(1, live_workers=1)
    transport.publish_round(RoundPublish(round=0, model=transport.put_blob(_initial_model(spec))))
    config = task_config(spec, transport.put_blob(corpus), "worker", 0, 1)
    with pytest.raises(ServiceError, match="corrupted"):
        run_worker(config, transport, poll_interval_s=POLL)
    assert transport.contributions(0).contributions == []
