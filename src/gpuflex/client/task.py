"""``TaskClient``: the round protocol over HTTP for a task subprocess, with its lease-scoped token.

It has the shape of ``gpuflex.train.transport.Transport``. Calls ride out a coordinator restart
(retries for ``retry_for_s``) so a brief outage does not kill a round's work.
"""

from __future__ import annotations

from gpuflex.client import direct
from gpuflex.client.http import HttpSession, get_blob
from gpuflex.protocol import messages as m
from gpuflex.protocol.relay import RelayEvent, RelayEvents, RelayPhase, RelayWork, ReplicaPhase


class TaskClient:
    def __init__(self, url: str, task_token: str, *, retry_for_s: float = 60.0, transport=None, ca=None):
        self.http = HttpSession(
            url,
            headers={"Authorization": f"Bearer {task_token}"},
            retry_for_s=retry_for_s,
            timeout_s=120.0,
            transport=transport,
            ca=ca,
        )

    def close(self) -> None:
        self.http.close()

    def get_blob(self, digest: str) -> bytes:
        return get_blob(self.http, digest)

    def put_blob(self, data: bytes) -> str:
        return direct.upload(self.http, data)

    def latest_round(self) -> m.RoundState | None:
        response = self.http.request("GET", "/v1/task/round")
        return None if response.status_code == 204 else m.RoundState.model_validate(response.json())

    def round_state(self, round: int) -> m.RoundState:
        return m.RoundState.model_validate(self.http.request("GET", f"/v1/task/rounds/{round}").json())

    def submit_contribution(self, contribution: m.ContributionSubmit) -> m.ContributionReceipt:
        response = self.http.request("POST", "/v1/task/contributions", json=contribution.model_dump())
        return m.ContributionReceipt.model_validate(response.json())

    def submit_audit_state(self, audit: m.AuditStateSubmit) -> None:
        self.http.request("POST", "/v1/task/audit-states", json=audit.model_dump())

    def assign_peer_audit(self, a: m.PeerAuditAssign) -> None:
        self.http.request("POST", "/v1/task/peer-audits", json=a.model_dump())

    def peer_audits(self, round: int | None = None) -> m.PeerAuditList:
        params = {} if round is None else {"round": round}
        response = self.http.request("GET", "/v1/task/peer-audits", params=params)
        return m.PeerAuditList.model_validate(response.json())

    def report_peer_audit(self, r: m.PeerAuditReport) -> None:
        self.http.request("POST", "/v1/task/peer-audits/report", json=r.model_dump())

    def report_verdict(self, verdict: m.VerdictSubmit) -> None:
        self.http.request("POST", "/v1/task/verdicts", json=verdict.model_dump())

    def post_secagg(self, p: m.SecAggPost) -> None:
        self.http.request("POST", "/v1/task/secagg", json=p.model_dump())

    def secagg_messages(self, round: int, after: int = -1) -> m.SecAggList:
        response = self.http.request("GET", "/v1/task/secagg", params={"round": round, "after": after})
        return m.SecAggList.model_validate(response.json())

    def contributions(self, round: int) -> m.ContributionList:
        response = self.http.request("GET", "/v1/task/contributions", params={"round": round})
        return m.ContributionList.model_validate(response.json())

    def publish_round(self, publish: m.RoundPublish) -> None:
        self.http.request("POST", "/v1/task/rounds", json=publish.model_dump())

    def relay_poll(self, wait_s: float) -> RelayWork:
        """A deployment's replica: the requests to serve and cancel, waiting up to ``wait_s`` for some."""
        response = self.http.request("GET", "/v1/task/relay", params={"wait": wait_s})
        return RelayWork.model_validate(response.json())

    def relay_phase(self, phase: ReplicaPhase) -> None:
        """A deployment's replica, before its first poll: what it is doing (its deployment's view says it)."""
        self.http.request("POST", "/v1/task/relay/phase", json=RelayPhase(phase=phase).model_dump())

    def relay_events(self, events: list[RelayEvent]) -> None:
        body = RelayEvents(events=events).model_dump(mode="json", exclude_defaults=True)
        self.http.request("POST", "/v1/task/relay/events", json=body)

    def log(self, message: str) -> None:
        self.http.request("POST", "/v1/task/log", json=m.TaskLog(message=message[:2000]).model_dump())
