"""A node's inference audits: served requests of deployments re-checked by one prefill, findings signed.

    claimed = client.claim_inference_audits(n)          # the coordinator picks what this node may judge
    verify(model, prompt, tokens, params, fingerprints)  # serve.verify: fingerprints and sampling replay
    client.report_inference_finding(audit.id, finding)   # signed with the node's key, as every node call

A core node audits any deployment; a community node, only while no core node is online, the deployments
it serves a replica of (the coordinator's rule, ``services.inference_audits``). The model is loaded once
from the node's cache (``server.served_directory``: the files a replica of it fetched are there already)
in the deployment's dtype, as its replicas serve it, and kept while the audits are of it; the check is
one prefill, no decoding and no gradients, judged by the thresholds of that dtype.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math

import torch

from gpuflex.agent.server import served_directory
from gpuflex.client import NodeClient
from gpuflex.data.cache import ShardCache
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeployedModel
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams
from gpuflex.serve.verify import Finding, verify

log = logging.getLogger("gpuflex.auditor")

CLAIM = 4  # audits claimed at once: a claim not judged in time goes to another auditor


class InferenceAuditor:
    def __init__(self, client: NodeClient, cache: ShardCache, threads: int = 0):
        """``threads``: torch's threads for the prefill (0: its default, every core)."""
        if threads:
            torch.set_num_threads(threads)
        self.client, self.cache = client, cache
        self._loaded: tuple[str, ServedModel] | None = None  # the model last audited, by its spec

    def run_once(self) -> int:
        """Claim pending audits, judge each, report each finding; how many were judged."""
        audits = self.client.claim_inference_audits(CLAIM).audits
        for audit in audits:
            finding = self.check(audit)
            log.info("inference audit %d of %s: %s", audit.id, audit.deployment_id, finding.reason)
            self.client.report_inference_finding(
                audit.id,
                m.InferenceFinding(ok=finding.ok, reason=finding.reason[:500], numbers=_evidence(finding)),
            )
        return len(audits)

    def check(self, audit: m.InferenceAudit) -> Finding:
        try:
            fingerprints = [base64.b64decode(f, validate=True) for f in audit.fingerprints]
        except binascii.Error as err:
            return Finding(False, f"a fingerprint is not base64: {err}")
        params = SamplingParams(audit.temperature, audit.top_p, max(1, len(audit.tokens)), seed=audit.seed)
        model = self._model(audit.model, audit.dtype)
        return verify(model, audit.prompt, audit.tokens, params, fingerprints)

    def _model(self, model: DeployedModel, dtype: str) -> ServedModel:
        """The model as the deployment's replicas serve it: its numerics are what the audit compares."""
        key = f"{dtype} {model.model_dump_json()}"
        if self._loaded is None or self._loaded[0] != key:
            self._loaded = None  # the previous model's memory goes before the next loads
            with served_directory(model, self.client.get_blob, self.cache) as directory:
                self._loaded = (key, ServedModel.load(directory, dtype=dtype))
        return self._loaded[1]


def _evidence(finding: Finding) -> dict[str, float | None]:
    """The finding's numbers as evidence: an infinite one (nothing shared to compare) is unknown."""
    return {k: (v if math.isfinite(v) else None) for k, v in finding.numbers.items()}
