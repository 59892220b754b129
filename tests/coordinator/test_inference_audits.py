"""Inference audits in the control plane, through the real API on SQLite and PostgreSQL: which served
requests are drawn, which node may claim them (a core node; a replica of another provider only while no
core node is online), and what a finding does (a pass counts, a failure is a verdict: slash, bar, lease
ended, replica placed again; once per node)."""

from __future__ import annotations

import pytest

from gpuflex.auth.signing import node_id_for
from gpuflex.cli.deploy import upload_served_model
from gpuflex.coordinator.services import inference_audits
from gpuflex.errors import Conflict, Forbidden, NotFound
from gpuflex.protocol import messages as m
from gpuflex.serve.engine import Completion, Usage
from gpuflex.serve.sampling import SamplingParams

from .test_deployments import held, model_dir, spec  # noqa: F401 (model_dir: a fixture)

FAILED = m.InferenceFinding(ok=False, reason="chunk 0: 12% of the top-k shared", numbers={"common_min": 0.12})
PASSED = m.InferenceFinding(ok=True, reason="fingerprints and sampling agree", numbers={"common_min": 1.0})


def completion(resumed: int = 0) -> Completion:
    return Completion(
        prompt=(5, 6, 7),
        tokens=(8, 9),
        text="ab",
        finish_reason="length",
        params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2, seed=2**64 - 1),
        usage=Usage(3, 2 - resumed, resumed),
        fingerprints=(b"\x01\x02", b"\x03"),
    )


class Served:
    """A deployment with replicas on community nodes n0 and n1 (n1 staked), and a core node."""

    def __init__(self, coordinator, model_dir, audit_rate: float = 1.0, dtype: str = "auto"):  # noqa: F811
        self.coordinator = coordinator
        self.alice = coordinator.consumer("alice", deposit=5)
        model = upload_served_model(self.alice, model_dir)
        self.deployment = self.alice.deploy(spec(model, replicas=2, audit_rate=audit_rate, dtype=dtype)).id
        self.nodes = [coordinator.node(f"n{i}", price=0.2) for i in range(2)]
        self.grants = [n.lease() for n in self.nodes]
        self.core = coordinator.node("core", price=0.3, core=True)
        self.nodes[1].stake(2.0)

    def serve(self, replica: int, done: Completion | None = None) -> bool:
        """Replica ``replica`` completed a request: drawn for audit as the gateway draws it."""
        with self.coordinator.ctx.tx() as s:
            grant = self.grants[replica]
            return inference_audits.sample(s, self.deployment, grant.lease_id, done or completion(), 0.0)


@pytest.fixture
def served(coordinator, model_dir):  # noqa: F811
    return Served(coordinator, model_dir)


def test_a_drawn_request_is_kept_as_served_for_a_core_node_and_never_for_its_own_provider(
    served, monkeypatch
):
    assert served.serve(0) and served.serve(1)
    assert not served.serve(0, completion(resumed=1))  # its first tokens came from another replica
    assert served.nodes[0].claim_inference_audits(4).audits == []  # a core node is online: not for n0
    (first, second) = served.core.claim_inference_audits(4).audits
    assert (first.deployment_id, first.prompt, first.tokens) == (served.deployment, [5, 6, 7], [8, 9])
    assert (first.temperature, first.top_p, first.seed) == (0.7, 0.9, 2**64 - 1)
    assert first.fingerprints == ["AQI=", "Aw=="] and first.model == served.grants[0].task.model
    assert second.id > first.id
    other_core = served.coordinator.node("core2", core=True)
    assert other_core.claim_inference_audits(4).audits == []  # claimed: not handed out twice
    monkeypatch.setattr(inference_audits, "CLAIM_S", 0.0)  # (a node's signature outlives no minute of clock)
    assert len(other_core.claim_inference_audits(4).audits) == 2  # not judged in time: handed on
    assert served.alice.deployment(served.deployment).audits == m.InferenceAuditCounts(pending=2)


def test_the_deployments_dtype_reaches_its_replicas_and_their_auditors(coordinator, model_dir):  # noqa: F811
    served = Served(coordinator, model_dir, dtype="fp32")
    assert [grant.task.dtype for grant in served.grants] == ["fp32", "fp32"]
    assert served.serve(0)
    (audit,) = served.core.claim_inference_audits(4).audits
    assert audit.dtype == "fp32"  # the auditor computes as the replica did


def test_no_audit_is_drawn_at_rate_zero_nor_of_a_core_nodes_replica(coordinator, model_dir):  # noqa: F811
    quiet = Served(coordinator, model_dir, audit_rate=0.0)
    assert not quiet.serve(0)
    alice = quiet.alice
    trusted = alice.deploy(spec(upload_served_model(alice, model_dir), name="on-core", audit_rate=1.0))
    grant = quiet.core.lease()
    assert grant is not None and grant.job_id == trusted.id
    with coordinator.ctx.tx() as s:
        assert not inference_audits.sample(s, trusted.id, grant.lease_id, completion(), 0.0)


def test_without_a_core_node_a_replica_audits_another_providers_requests_only(served):
    served.core.leave()
    assert served.serve(0) and served.serve(1)
    (audit,) = served.nodes[0].claim_inference_audits(4).audits  # n1's request: its own is not for it
    assert audit.id == 2
    (audit,) = served.nodes[1].claim_inference_audits(4).audits
    assert audit.id == 1
    outsider = served.coordinator.node("n2")
    assert outsider.claim_inference_audits(4).audits == []  # serves no replica of it


def test_a_failed_audit_slashes_bars_and_replaces_the_replica_once_and_a_pass_counts(served):
    for replica in (0, 1, 1):
        served.serve(replica)
    audits = {a.id: a for a in served.core.claim_inference_audits(4).audits}
    assert sorted(audits) == [1, 2, 3]
    with pytest.raises(Forbidden, match="not claimed by this node"):
        served.nodes[0].report_inference_finding(2, FAILED)
    with pytest.raises(NotFound):
        served.core.report_inference_finding(99, FAILED)
    served.core.report_inference_finding(1, PASSED)
    served.core.report_inference_finding(2, FAILED)
    served.core.report_inference_finding(2, FAILED)  # the same again: no-op
    with pytest.raises(Conflict, match="already judged failed"):
        served.core.report_inference_finding(2, PASSED)
    served.core.report_inference_finding(3, FAILED)  # barred already: recorded, not slashed again

    shown = served.alice.deployment(served.deployment)
    assert shown.audits == m.InferenceAuditCounts(passed=1, failed=2)
    (verdict,) = shown.verdicts
    n1 = served.grants[1]
    assert (verdict.round, verdict.task_id, verdict.check, verdict.guilty) == (
        2,
        n1.task_id,
        "inference-audit",
        True,
    )
    assert verdict.slashed == 1.0 and verdict.evidence["common_min"] == 0.12
    assert served.nodes[1].wallet().stake == pytest.approx(1.0)
    assert n1.lease_id in served.nodes[1].heartbeat(held(n1)).revoked  # its replica's lease ended
    replacement = served.coordinator.node("n2", price=0.2).lease()  # placed again, never on n1
    assert replacement is not None and replacement.task_id == n1.task_id and replacement.epoch == 2
    assert served.nodes[1].lease() is None


def _id(node) -> str:
    return node_id_for(node.key.public_key_hex)


def test_a_community_auditors_failed_finding_convicts_no_one_until_a_core_node_finds_the_same(served):
    served.core.leave()
    n0, n1 = served.nodes
    served.serve(1)  # n1's request: n0 audits it
    (audit,) = n0.claim_inference_audits(4).audits
    n0.report_inference_finding(audit.id, FAILED)
    n0.report_inference_finding(audit.id, FAILED)  # its retry: the accusation stands, nothing more
    shown = served.alice.deployment(served.deployment)
    assert shown.audits == m.InferenceAuditCounts(referee=1) and shown.verdicts == []
    assert n1.wallet().stake == pytest.approx(2.0)  # nobody slashed on one provider's word
    log = [e.message for e in served.alice.deployment_logs(served.deployment)]
    assert any("a community auditor convicts no one alone: a core node referees it" in x for x in log), log
    assert n0.claim_inference_audits(4).audits == [] and n1.claim_inference_audits(4).audits == []

    referee = served.coordinator.node("core2", core=True)
    (again,) = referee.claim_inference_audits(4).audits  # only a core node may claim it now
    assert again.id == audit.id
    referee.report_inference_finding(audit.id, FAILED)
    shown = served.alice.deployment(served.deployment)
    assert shown.audits == m.InferenceAuditCounts(failed=1)
    (verdict,) = shown.verdicts
    assert verdict.node_id == _id(n1) and verdict.task_id == served.grants[1].task_id
    assert verdict.evidence["accuser"] == _id(n0) and verdict.evidence["auditor"] == _id(referee)
    assert n1.wallet().stake == pytest.approx(1.0)


def test_an_accusation_a_core_nodes_check_refutes_convicts_the_accuser(served):
    served.core.leave()
    n0, n1 = served.nodes
    served.serve(0)  # n0's request: n1 (staked) audits it, and lies
    (audit,) = n1.claim_inference_audits(4).audits
    n1.report_inference_finding(audit.id, FAILED)
    referee = served.coordinator.node("core2", core=True)
    referee.claim_inference_audits(4)
    referee.report_inference_finding(audit.id, PASSED)

    shown = served.alice.deployment(served.deployment)
    assert shown.audits == m.InferenceAuditCounts(passed=1)
    (verdict,) = shown.verdicts  # on the accuser, for the replica it serves; n0 is not touched
    assert (verdict.node_id, verdict.task_id) == (_id(n1), served.grants[1].task_id)
    assert "its failed finding on audit 1 of n0's replica" in verdict.reason
    assert "did not hold: a core node's check passed" in verdict.reason
    assert n1.wallet().stake == pytest.approx(1.0)
    assert served.grants[1].lease_id in n1.heartbeat(held(served.grants[1])).revoked
    assert served.grants[0].lease_id not in n0.heartbeat(held(served.grants[0])).revoked
