"""Whole jobs on one LocalTransport: an aggregator and workers in threads, on a tiny model."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpuflex.errors import BadRequest, ServiceError
from gpuflex.protocol.messages import ContributionReceipt, ContributionSubmit
from gpuflex.train.aggregator import run_aggregator
from gpuflex.train.checkpoint import sha256
from gpuflex.train.compression import get_compressor
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.recipes import build_model, for_task
from gpuflex.train.sync import sync
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport
from gpuflex.train.worker import Replica, WorkerSummary, _Loop, run_worker

from .helpers import POLL, Publisher, ThreadedJob, task_config, tiny_spec

TIMEOUT = 60  # seconds a whole job may take before the test calls it hung


def _run_job(corpus: bytes, workers: int = 2, **spec_fields) -> tuple[LocalTransport, dict, list[dict]]:
    spec = tiny_spec(**spec_fields)
    transport = LocalTransport(spec.rounds, live_workers=workers)
    dataset = transport.put_blob(corpus)
    with ThreadedJob(transport, spec, dataset, num_workers=workers) as job:
        running = [job.start("worker", i) for i in range(workers)]
        aggregator = job.start("aggregator").result(timeout=TIMEOUT)
        return transport, aggregator, [w.result(timeout=TIMEOUT) for w in running]


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
    assert history[-1].tokens == sum(w["tokens"] for w in workers)
    worker_lines = [m for task, m in transport.logs() if task == "worker-0"]
    assert worker_lines[0].startswith("joined at round 0, ")
    assert len(worker_lines) == 4 and all(line.endswith("accepted") for line in worker_lines[1:])


def test_after_joining_a_worker_receives_only_the_small_updates(corpus):
    transport, aggregator, workers = _run_job(corpus, rounds=4, compression="int8")
    history = transport.history()
    join = len(transport.get_blob(history[0].checkpoint))
    updates = [len(transport.get_blob(p.update)) for p in history[1:]]
    for w in workers:  # built from the job's seed, round 0 costs nothing; then every update but the last
        assert w["bytes_received"] == sum(updates[:-1])
    assert max(updates) < join / 4  # int8 of Δ, against the fp32 weights of round 0
    assert aggregator["bytes_published"] == sum(updates)


def test_a_rerun_reproduces_the_same_models(corpus):
    first, _, _ = _run_job(corpus, rounds=2)
    second, _, _ = _run_job(corpus, rounds=2)
    third, _, _ = _run_job(corpus, rounds=2, seed=1)
    assert [p.state_hash for p in first.history()] == [p.state_hash for p in second.history()]
    assert first.history()[-1].state_hash != third.history()[-1].state_hash


def test_a_replacement_aggregator_continues_exactly_where_its_predecessor_stopped(corpus):
    spec = tiny_spec(rounds=3, compression="none")  # no downlink residual: the resume is bit-exact
    uninterrupted, _, _ = _run_job(corpus, rounds=3, compression="none")
    transport = LocalTransport(3, live_workers=2)
    dataset = transport.put_blob(corpus)
    config = task_config(spec, dataset, "aggregator")

    def round_one_is_out() -> bool:
        latest = transport.latest_round()
        return latest is not None and latest.round >= 1

    with ThreadedJob(transport, spec, dataset) as job:
        workers = [job.start("worker", i) for i in range(2)]
        first = run_aggregator(config, transport, poll_interval_s=POLL, should_stop=round_one_is_out)
        second = run_aggregator(config, transport.for_task("aggregator-new"), poll_interval_s=POLL)
        results = [w.result(timeout=TIMEOUT) for w in workers]
    assert (first.start_round, first.round, first.finished) == (0, 1, False)
    assert (second.start_round, second.round, second.finished) == (1, 3, True)
    assert set(second.val_losses) == {2, 3}  # it published neither round 0 nor round 1 again
    assert [p.state_hash for p in transport.history()] == [p.state_hash for p in uninterrupted.history()]
    assert ("aggregator-new", "resuming at round 1 from checkpoint round 1") in transport.logs()
    assert all(r["contributed"] == [0, 1, 2] for r in results)


def test_an_aggregator_that_finds_the_job_finished_returns_at_once(corpus):
    transport, _, _ = _run_job(corpus, rounds=1)
    summary = run_aggregator(task_config(tiny_spec(rounds=1), sha256(corpus), "aggregator"), transport)
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


def test_workers_join_and_leave_between_rounds(corpus):
    spec = tiny_spec(rounds=5)
    transport = LocalTransport(5, live_workers=2)
    dataset = transport.put_blob(corpus)
    with ThreadedJob(transport, spec, dataset, num_workers=3) as job:
        first = [job.start("worker", i) for i in range(2)]
        aggregator = job.start("aggregator")
        while (latest := transport.latest_round()) is None or latest.round < 2:
            assert not aggregator.done(), aggregator.exception()
            time.sleep(POLL)
        transport.set_live_workers(3)
        joiner = job.start("worker", 2)
        assert aggregator.result(timeout=TIMEOUT)["finished"]
        late = joiner.result(timeout=TIMEOUT)
        early = [f.result(timeout=TIMEOUT) for f in first]
    assert late["contributed"] and min(late["contributed"]) >= 2  # it started from the newest model
    assert all(r["finished"] for r in early)
    assert transport.history()[-1].contributions == 3


class _RoundClosesWhileTraining(LocalTransport):
    """Fault injector: the next round is published just before this worker's round-0 upload lands."""

    publisher: Publisher

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        if c.round == 0:
            self.publisher.next_round()
            return super().submit_contribution(c)
        accepted = super().submit_contribution(c)
        self.publisher.next_round()
        return accepted


def _injector(spec) -> _RoundClosesWhileTraining:
    transport = _RoundClosesWhileTraining(spec.rounds, live_workers=1)
    transport.publisher = Publisher(transport, spec)
    return transport


def test_a_stale_worker_drops_its_contribution_and_joins_the_next_round(corpus):
    spec = tiny_spec(rounds=2)
    transport = _injector(spec)
    dataset = transport.put_blob(corpus)
    summary = run_worker(task_config(spec, dataset, "worker", 0, 1), transport, poll_interval_s=POLL)
    assert summary.stale == [0] and summary.contributed == [1] and summary.finished
    assert len(transport.contributions(1).contributions) == 1
    assert transport.contributions(0).contributions == []
    assert transport.logs()[0][1].startswith("joined at round 0, ")
    assert "stale" in transport.logs()[1][1]


class _JoinedLate(LocalTransport):
    """Fault injector: round 0 is a minute old when the worker looks; each contribution closes its round."""

    publisher: Publisher

    def latest_round(self):
        state = super().latest_round()
        if state is not None and state.round == 0:
            return state.model_copy(update={"age_s": 60.0})
        return state

    def submit_contribution(self, c: ContributionSubmit) -> ContributionReceipt:
        accepted = super().submit_contribution(c)
        self.publisher.next_round()
        return accepted


def test_a_worker_joining_a_round_past_its_time_budget_still_trains_a_share_of_it(corpus):
    # a quarter of 4 s: room for many steps even where both cores are busy with other tests' processes
    spec = tiny_spec(rounds=1, inner_steps=100_000, round_seconds=4.0)
    transport = _JoinedLate(spec.rounds, live_workers=1)
    transport.publisher = Publisher(transport, spec)
    dataset = transport.put_blob(corpus)
    summary = run_worker(task_config(spec, dataset, "worker", 0, 1), transport, poll_interval_s=POLL)
    assert summary.contributed == [0] and summary.finished
    assert transport.contributions(0).contributions[0].steps > 1  # not one step of a fresh AdamW


def test_a_stale_contribution_leaves_no_error_feedback_residual(corpus):
    spec = tiny_spec(rounds=2, compression="int8")
    transport = _injector(spec)
    config = task_config(spec, transport.put_blob(corpus), "worker", 0, 1)
    replica = Replica(config, *for_task(config, transport.get_blob))
    loop = _Loop(replica, transport, WorkerSummary(), POLL, lambda: False)
    with ThreadPoolExecutor(max_workers=1) as exchange:
        loop.exchange = exchange
        loop.run()
    assert loop.summary.stale == [0] and loop.summary.contributed == [1]
    # only round 1's encoding error is carried: round 0's was reverted with its refused contribution
    assert replica.feedback.residual.keys() == {n for n, _ in replica.model.named_parameters()}
    adam_steps = {state["step"].item() for state in replica.optimizer.state.values()}
    assert adam_steps == {2 * spec.inner_steps}  # the inner optimizer's state carries across rounds


def test_a_stopped_worker_returns_without_contributing(corpus):
    spec = tiny_spec(rounds=2)
    transport = LocalTransport(2, live_workers=1)
    dataset = transport.put_blob(corpus)
    Publisher(transport, spec)
    steps = iter(range(1000))
    summary = run_worker(
        task_config(spec, dataset, "worker", 0, 1),
        transport,
        poll_interval_s=POLL,
        should_stop=lambda: next(steps) > 3,
    )
    assert summary.contributed == [] and not summary.finished
    assert transport.contributions(0).contributions == []


def test_run_task_refuses_an_unknown_role():
    config = task_config(tiny_spec(), "0" * 64, "worker").model_copy(update={"role": "referee"})
    with pytest.raises(BadRequest, match="unknown task role 'referee'"):
        run_task(config, LocalTransport(1, 1))


def test_a_worker_refuses_a_corrupted_blob(corpus):
    class CorruptBlobs(LocalTransport):
        def get_blob(self, digest: str) -> bytes:
            data = super().get_blob(digest)
            return data if data == corpus else data[:-1] + bytes([data[-1] ^ 1])

    spec = tiny_spec(rounds=2)
    transport = CorruptBlobs(2, live_workers=1)
    Publisher(transport, spec).next_round()  # the worker joins at round 1: it fetches round 1's update
    config = task_config(spec, transport.put_blob(corpus), "worker", 0, 1)
    with pytest.raises(ServiceError, match="corrupted"):
        run_worker(config, transport, poll_interval_s=POLL)
    assert transport.contributions(1).contributions == []


def test_a_replica_replays_updates_and_resyncs_from_the_checkpoint_when_it_drifted(corpus):
    transport, _, _ = _run_job(corpus, rounds=3, checkpoint_every=2)
    spec = tiny_spec(rounds=3, checkpoint_every=2)
    decode = get_compressor(spec.compression).decompress
    round0 = transport.get_blob(transport.history()[0].checkpoint)
    latest = transport.latest_round()

    honest = GlobalReplica(build_model(spec), spec)
    honest.load(round0)
    received = sync(honest, transport, latest, decode)
    assert honest.state_hash() == latest.state_hash
    assert received == sum(len(transport.get_blob(p.update)) for p in transport.history()[1:])

    drifted = GlobalReplica(build_model(spec), spec)
    drifted.load(round0)
    with torch.no_grad():
        next(iter(drifted.parameters().values())).add_(1e-3)  # a bit flip, a different GPU ...
    sync(drifted, transport, latest, decode)
    assert drifted.state_hash() == latest.state_hash
    assert any("drifted" in m for _, m in transport.logs())


def test_overlapped_rounds_train_and_contribute_every_round(corpus):
    transport, aggregator, workers = _run_job(corpus, rounds=4, overlap=True)
    history = transport.history()
    assert aggregator["finished"] and [p.contributions for p in history] == [0, 2, 2, 2, 2]
    assert history[-1].val_loss < history[0].val_loss - 0.5
    for w in workers:
        assert w["contributed"] == [0, 1, 2, 3] and w["finished"]


def test_time_budgeted_rounds_let_each_worker_run_what_fits(corpus):
    transport, _, workers = _run_job(corpus, rounds=2, inner_steps=100_000, round_seconds=0.3)
    spec = tiny_spec()
    for w in workers:
        steps = w["tokens"] // (spec.batch_size * spec.model.block_size)
        assert 2 <= steps < 2 * 100_000  # bounded by time, not by the step cap
    assert transport.history()[-1].tokens == sum(w["tokens"] for w in workers)


def test_a_replica_built_from_the_jobs_seed_joins_without_downloading_the_model(corpus):
    transport, _, _ = _run_job(corpus, rounds=3)
    spec = tiny_spec(rounds=3)
    decode = get_compressor(spec.compression).decompress
    latest = transport.latest_round()
    updates = sum(len(transport.get_blob(p.update)) for p in transport.history()[1:])

    seeded = GlobalReplica(build_model(spec), spec)
    assert sync(seeded, transport, latest, decode) == updates  # the updates only: no checkpoint
    assert seeded.state_hash() == latest.state_hash
    at_start = GlobalReplica(build_model(spec), spec)
    assert sync(at_start, transport, transport.round_state(0), decode) == 0 and at_start.round == 0

    stranger = GlobalReplica(build_model(tiny_spec(seed=7)), spec)  # another init: the checkpoint it is
    received = sync(stranger, transport, latest, decode)
    assert stranger.state_hash() == latest.state_hash
    assert received == len(transport.get_blob(latest.checkpoint))
