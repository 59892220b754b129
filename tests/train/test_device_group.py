"""A replica spanning two local ranks (gloo on CPU here; NCCL across a provider's GPUs)."""

import multiprocessing

import pytest

from gpuflex.errors import SpecError
from gpuflex.protocol.spec import parse_job_spec
from gpuflex.train.transport import LocalTransport

from .helpers import ThreadedJob, tiny_spec

TIMEOUT = 120


def _one_worker_job(corpus: bytes, local_devices: int) -> tuple[LocalTransport, dict]:
    spec = tiny_spec(rounds=2, local_devices=local_devices, verification={"robust": False})
    transport = LocalTransport(2, live_workers=1)
    with ThreadedJob(transport, spec, transport.put_blob(corpus), num_workers=1) as job:
        worker = job.start("worker", 0)
        assert job.start("aggregator").result(timeout=TIMEOUT)["finished"]
        return transport, worker.result(timeout=TIMEOUT)


def test_a_worker_spanning_two_ranks_trains_on_both_and_leaves_no_process(corpus):
    transport, summary = _one_worker_job(corpus, local_devices=2)
    single, _ = _one_worker_job(corpus, local_devices=1)
    spec = tiny_spec()
    history = transport.history()
    assert summary["finished"] and summary["contributed"] == [0, 1]
    per_rank = spec.inner_steps * spec.batch_size * spec.model.block_size
    assert summary["tokens"] == 2 * 2 * per_rank  # two rounds, two ranks each
    assert history[-1].val_loss < history[0].val_loss - 0.3
    assert multiprocessing.active_children() == []
    # rank 0 draws the single-rank batches; rank 1's gradients, averaged in, change the result
    assert history[-1].state_hash != single.history()[-1].state_hash


def test_time_budgets_and_several_ranks_do_not_combine_yet():
    with pytest.raises(SpecError, match="local_devices"):
        parse_job_spec({"name": "x", "training": {"local_devices": 2, "round_seconds": 5}})


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_replica_over_two_ranks_commits_and_its_audits_re_run_both_ranks(corpus, optimizer):
    """Rank 0 commits for the replica; an audit re-runs a segment on the mean gradient of both ranks'
    batches (within the cross-class tolerance: an all-reduce's sums are not one process's). Each rank
    builds the same inner optimizer."""
    spec = tiny_spec(
        rounds=2,
        local_devices=2,
        inner_optimizer=optimizer,
        verification={"audit_rate": 1.0, "trace_every": 4},
    )
    transport = LocalTransport(2, live_workers=1, audit_rate=1.0)
    with ThreadedJob(transport, spec, transport.put_blob(corpus), num_workers=1) as job:
        worker = job.start("worker", 0)
        assert job.start("aggregator").result(timeout=TIMEOUT)["finished"]
        assert worker.result(timeout=TIMEOUT)["contributed"] == [0, 1]
    audits = [v for v in transport.verdicts() if v.check == "audit"]
    assert len(audits) == 2 and not any(v.guilty for v in transport.verdicts()), transport.verdicts()
    assert all("within tolerance" in v.reason for v in audits)
    # far inside the 1e-3 tolerance: AdamW's about 1e-8; Muon's about 4e-5, since it orthogonalises in
    # bf16, whose rounding turns the all-reduce's last-bit differences into larger ones
    assert all(v.evidence["distance"] < 1e-4 for v in audits)
