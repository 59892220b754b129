"""``NodeClient``: a provider node's calls, each signed with its Ed25519 key."""

from __future__ import annotations

from gpuflex.auth.signing import NodeKey
from gpuflex.client.http import HttpSession, get_blob
from gpuflex.protocol import messages as m


class NodeClient:
    def __init__(self, url: str, key: NodeKey, *, retry_for_s: float = 0.0, transport=None, ca=None):
        self.key = key
        self.http = HttpSession(
            url, sign=key.sign_request, retry_for_s=retry_for_s, transport=transport, ca=ca
        )

    def close(self) -> None:
        self.http.close()

    def register(self, msg: m.NodeRegister) -> m.NodeRegistered:
        response = self.http.request("POST", "/v1/nodes/register", json=msg.model_dump(mode="json"))
        return m.NodeRegistered.model_validate(response.json())

    def heartbeat(self, held: list[m.LeaseHeld]) -> m.HeartbeatAck:
        body = m.Heartbeat(leases=held).model_dump()
        return m.HeartbeatAck.model_validate(
            self.http.request("POST", "/v1/nodes/heartbeat", json=body).json()
        )

    def lease(self) -> m.LeaseGrant | None:
        response = self.http.request("POST", "/v1/nodes/lease")
        return None if response.status_code == 204 else m.LeaseGrant.model_validate(response.json())

    def report(self, lease_id: str, msg: m.LeaseReport) -> None:
        self.http.request("POST", f"/v1/nodes/leases/{lease_id}/report", json=msg.model_dump())

    def get_blob(self, digest: str) -> bytes:
        return get_blob(self.http, digest)

    def claim_inference_audits(self, limit: int) -> m.InferenceAuditList:
        body = m.InferenceAuditClaim(limit=limit).model_dump()
        response = self.http.request("POST", "/v1/nodes/inference-audits/claim", json=body)
        return m.InferenceAuditList.model_validate(response.json())

    def report_inference_finding(self, audit_id: int, finding: m.InferenceFinding) -> None:
        body = finding.model_dump(mode="json")
        self.http.request("POST", f"/v1/nodes/inference-audits/{audit_id}/finding", json=body)

    def lease_key(self, lease_id: str, epoch: int) -> m.LeaseKey:
        """An encrypted job's data key sealed to us for this live lease, or why not yet."""
        body = m.LeaseKeyAsk(epoch=epoch).model_dump()
        response = self.http.request("POST", f"/v1/nodes/leases/{lease_id}/key", json=body)
        return m.LeaseKey.model_validate(response.json())

    def leave(self) -> None:
        self.http.request("POST", "/v1/nodes/leave")

    def wallet(self) -> m.NodeWallet:
        return m.NodeWallet.model_validate(self.http.request("GET", "/v1/nodes/wallet").json())

    def stake(self, amount: float, source: m.StakeSource = "deposit") -> m.NodeWallet:
        return self._move("stake", m.StakeChange(amount=amount, source=source))

    def unstake(self, amount: float) -> m.NodeWallet:
        return self._move("unstake", m.Withdrawal(amount=amount))

    def withdraw(self, amount: float) -> m.NodeWallet:
        return self._move("withdraw", m.Withdrawal(amount=amount))

    def _move(self, action: str, body: m.Message) -> m.NodeWallet:
        response = self.http.request("POST", f"/v1/nodes/{action}", json=body.model_dump())
        return m.NodeWallet.model_validate(response.json())

    def propose(self, msg: m.ProposalCreate) -> m.ProposalInfo:
        """Propose a new value for a network parameter, as this node (it needs stake)."""
        body = msg.model_dump(mode="json")
        return m.ProposalInfo.model_validate(
            self.http.request("POST", "/v1/governance/proposals", json=body).json()
        )

    def vote(self, proposal_id: str, choice: m.VoteChoice) -> m.VoteInfo:
        """Vote with this node's stake; votes are final."""
        body = m.VoteCast(choice=choice).model_dump()
        path = f"/v1/governance/proposals/{proposal_id}/votes"
        return m.VoteInfo.model_validate(self.http.request("POST", path, json=body).json())
