"""The auditor's own part of an inference audit (the prefill check is ``serve.verify``'s, tested there):
a claim it cannot decode fails without loading a model, and a finding's numbers travel as evidence."""

import math

from gpuflex.agent.auditor import InferenceAuditor, _evidence
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.serve.verify import Finding


def test_fingerprints_that_are_not_base64_fail_the_audit():
    audit = m.InferenceAudit(
        id=1,
        deployment_id="d-1",
        model=DeployedModel(job="j-1"),
        prompt=[1, 2],
        tokens=[3],
        temperature=0.0,
        top_p=1.0,
        seed=0,
        fingerprints=["not base64!"],
    )
    finding = InferenceAuditor(client=None, cache=None).check(audit)  # no model is needed to refuse it
    assert not finding.ok and "not base64" in finding.reason


def test_a_number_with_nothing_to_compare_is_sent_as_unknown():
    finding = Finding(False, "chunk 0 shares nothing", {"common_min": 0.0, "mantissa_mean": math.inf})
    evidence = _evidence(finding)
    assert evidence == {"common_min": 0.0, "mantissa_mean": None}
    m.InferenceFinding(ok=False, reason=finding.reason, numbers=evidence)  # the wire takes it (no inf)
