"""Every adversary kind is caught, and honest workers never are (heterogeneous shards, top-k, late)."""

import pytest
import torch

from gpuflex.errors import BadRequest
from gpuflex.testing import small_job, write_corpus
from gpuflex.train import adversaries
from gpuflex.train.audit import Claim, audit
from gpuflex.train.corpus import build_corpus
from gpuflex.train.drill import LATE, Drill

from .helpers import tiny_spec


def _spec(rounds: int = 2, trace_every: int = 1, **overrides):
    fields = {
        "rounds": rounds,
        "inner_steps": 4,
        "compression": {"method": "topk", "density": 0.1, "values": "int8"},
        "verification": {"trace_every": trace_every, "audit_rate": 1.0},
    }
    return tiny_spec(**{**fields, **overrides})


def _last_segment(worker, commitment):
    return len(commitment.trace) - 1  # few-steps and adaptive pad the end of their trace


@pytest.mark.parametrize("kind", sorted(set(adversaries.TRAINING_KINDS) - {"skip-segment"}))
def test_each_kind_is_caught_within_its_cheating_rounds(corpus, kind):
    rounds = {"jump": adversaries.JUMP_AFTER + 1, "stale": 2, "fake-trace": 2}.get(kind, 1)  # its first cheat
    drill = Drill(_spec(rounds), corpus, [None, None, None, LATE, kind])
    convicted = []
    for r in range(rounds):
        judged, _ = drill.round(r, _last_segment)
        assert not any(j.guilty for j in judged[:4]), [j.verdict for j in judged[:4] if j.guilty]
        convicted.append(judged[4].guilty)
    assert any(convicted), f"{kind} was never caught"


def test_honest_workers_are_never_convicted(corpus):
    drill = Drill(_spec(3), corpus, [None, None, None, None, LATE])
    for r in range(3):
        judged, _ = drill.round(r, lambda worker, c, r=r: (worker + r) % len(c.trace))
        assert [j.verdict.guilty for j in judged] == [False] * 5  # each audited, each cleared


def test_alie_passes_every_screen_and_only_the_audit_of_its_binding_convicts_it(corpus):
    drill = Drill(_spec(1), corpus, [None, None, None, None, "alie"])
    judged, _ = drill.round(0, lambda worker, c: 0 if worker == 4 else None)
    assert [j.guilty for j in judged] == [False] * 4 + [True]
    assert judged[4].verdict.check == "audit" and judged[4].verdict.evidence["binding"] == "delta"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_shirker_of_one_segment_passes_every_screen_and_only_an_audit_of_that_segment_sees_it(
    corpus, optimizer
):
    """The limit of spot checks: an audit catches it with the chance its segment is drawn. With either
    inner optimizer, every honest worker's drawn segment re-runs bit for bit."""
    spec = _spec(1, trace_every=2, inner_steps=8, inner_optimizer=optimizer)
    findings = {}
    for segment in range(4):
        drill = Drill(spec, corpus, [None, None, None, None, "skip-segment"])
        judged, results = drill.round(0, lambda worker, c, segment=segment: segment)
        assert not any(j.guilty for j in judged[:4])
        assert results[4].steps == 8  # it claims every step
        traced = results[0].trace.kept[1]
        assert any(k.startswith("momentum_buffer.") for k in traced) == (optimizer == "muon")
        findings[segment] = judged[4].verdict
    caught = [s for s, v in findings.items() if v.guilty]
    assert len(caught) == 1, findings
    assert findings[caught[0]].check == "audit" and "reproduce" in findings[caught[0]].reason


def test_with_peer_audits_a_framer_is_convicted_and_the_worker_it_audited_is_cleared(corpus):
    """Each of the 2 workers is the other's only peer; the framer changes the last hash it reports,
    and the core node's re-run of that one segment clears the accused and convicts the framer."""
    spec = _spec(1).model_copy(
        update={"verification": _spec(1).verification.model_copy(update={"peer_segments": 2})}
    )
    drill = Drill(spec, corpus, [None, "framer"])
    judged, _ = drill.round(0, lambda worker, c: 0)
    accused, framer = (j.verdict for j in judged)
    assert (accused.guilty, accused.check, accused.evidence["segment"]) == (False, "dispute", 1), accused
    assert (framer.guilty, framer.check, framer.evidence["task"]) == (True, "dispute", "w0"), framer
    assert drill.peer_s > 0


def test_an_unknown_kind_is_a_clear_error():
    with pytest.raises(BadRequest, match="unknown adversary"):
        adversaries.get("nice")


def test_without_robust_aggregation_nothing_is_checked_and_a_poison_moves_the_plain_mean(corpus):
    """``verification.robust: false`` is the naive token-weighted mean the benchmark reports beside."""
    plain = _spec(1).model_copy(
        update={"verification": _spec(1).verification.model_copy(update={"robust": False})}
    )
    runs = {}
    for robust, spec in ((True, _spec(1)), (False, plain)):
        drill = Drill(spec, corpus, [None, None, None, None, "scaled"])
        before = {n: p.detach().clone() for n, p in drill.global_.parameters().items()}
        judged, _ = drill.round(0, lambda worker, c: None)
        step = sum(float((p.detach() - before[n]).norm()) for n, p in drill.global_.parameters().items())
        runs[robust] = ([j.guilty for j in judged], step)
    assert runs[True][0] == [False] * 4 + [True] and runs[False][0] == [False] * 5
    assert runs[False][1] > 2 * runs[True][1]  # the scaled poison went into the plain mean


def test_honest_workers_of_a_small_fast_job_are_never_convicted(tmp_path):
    """The integration tests' job: word-salad text, 8 steps at lr 0.01, warm-up, a late worker. One
    batch's loss gain is noise for an honest delta once the loss flattens, and in warm-up a late worker's
    steps move the model far less than their number says (both convicted honest workers here)."""
    write_corpus(tmp_path / "data")
    corpus = b"".join(p.read_bytes() for p in sorted((tmp_path / "data").iterdir()))
    spec = small_job(tmp_path / "data", workers=4, rounds=30, inner_steps=8, batch_size=8).training
    drill = Drill(spec, corpus, [None, None, None, LATE])
    for r in range(spec.rounds):
        judged, _ = drill.round(r, lambda worker, c: None)
        assert not any(j.guilty for j in judged), (r, [j.verdict for j in judged if j.guilty])


def test_honest_workers_of_an_overlapped_int2_job_are_never_convicted():
    """An overlapped worker begins each round from the previous model less its own last delta: judged from
    the round's model instead, its honest delta overshot, and this job convicted worker 1 in rounds 9-11
    (``bench/diloco_vs_ddp.py``'s int2-overlap job, 3 of its 4 workers)."""
    spec = tiny_spec(
        rounds=12,
        inner_steps=30,
        batch_size=16,
        overlap=True,
        compression={"method": "int2"},
        outer_lr=1.5,
        outer_momentum=0.0,
    )
    drill = Drill(spec, build_corpus("stdlib", 300_000, [".py"]), [None] * 4)
    for r in range(spec.rounds):
        judged, _ = drill.round(r, lambda worker, c: None)
        assert not any(j.guilty for j in judged), (r, [j.verdict for j in judged if j.guilty])


def test_a_residual_forged_to_bind_a_poison_breaks_the_chain_and_a_fresh_residual_does_not(corpus):
    """forged-residual trains and commits honestly and compresses ALIE out of a forged residual: the
    audit's binding holds for it; the residual chain convicts it, at the screen, every round."""
    drill = Drill(_spec(2), corpus, [None, None, None, LATE, "forged-residual"])
    for r in range(2):
        if r == 1:  # worker 0's task went to a replacement node: an empty residual is a valid start
            drill.restart(0)
        judged, results = drill.round(r, _last_segment)
        assert [j.guilty for j in judged] == [False] * 4 + [True], [j.verdict for j in judged]
        assert judged[4].verdict.check == "screen" and "previous contribution" in judged[4].verdict.reason
    c = results[4].commitment
    generator = torch.Generator().manual_seed(c.seed)
    batches = [drill.data[4].sample(generator) for _ in range(results[4].steps)]
    claim = Claim(1, results[4].steps, c, 0, judged[4].delta)
    finding = audit(drill.spec, drill.recipe, batches, claim, results[4].audit_state(0))
    assert not finding.guilty, finding  # its delta is its training compressed with the residual it names


def test_a_chain_count_that_does_not_follow_the_previous_one_is_convicted(corpus):
    """A worker that claims a longer chain than it has (to be judged against older, longer deltas' norms,
    or a shorter one to dodge them) breaks the count the coordinator carries from its last contribution."""
    drill = Drill(_spec(2), corpus, [None] * 5)
    drill.round(0, lambda worker, c: None)
    drill.replicas[1].feedback.compressions += 3
    drill.restart(2)  # a fresh worker, which then claims a long chain for its empty residual
    drill.replicas[2].feedback.compressions = 5
    judged, _ = drill.round(1, lambda worker, c: None)
    assert [j.guilty for j in judged] == [False, True, True, False, False]
    assert "chain of 4 compressions" in judged[1].verdict.reason
    assert "empty, yet it claims 5" in judged[2].verdict.reason
