"""``Client``: what a consumer does — sign up, fund a wallet, submit and follow jobs, audit the ledger,
read the network's governance."""

from __future__ import annotations

import hashlib

from gpuflex.client.http import HttpSession
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec


class Client:
    """``Client(url, token)``; ``Client(url)`` can only create an account."""

    def __init__(self, url: str, token: str | None = None, *, retry_for_s: float = 0.0, transport=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = HttpSession(url, headers=headers, retry_for_s=retry_for_s, transport=transport)

    def close(self) -> None:
        self.http.close()

    def create_account(self, name: str) -> m.AccountCreated:
        body = m.AccountCreate(name=name).model_dump()
        return m.AccountCreated.model_validate(self.http.request("POST", "/v1/accounts", json=body).json())

    def balance(self) -> m.Balance:
        return m.Balance.model_validate(self.http.request("GET", "/v1/wallet").json())

    def deposit(self, amount: float) -> m.Balance:
        body = m.Deposit(amount=amount).model_dump()
        return m.Balance.model_validate(self.http.request("POST", "/v1/wallet/deposit", json=body).json())

    def upload(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.http.request("PUT", f"/v1/blobs/{digest}", content=data)
        return digest

    def submit(self, spec: JobSpec, dataset: str | None = None, recipe_code: str | None = None) -> m.JobInfo:
        """Submit a job whose inputs (dataset, user recipe file) are already uploaded."""
        body = m.JobSubmit(spec=spec, dataset=dataset, recipe_code=recipe_code).model_dump(mode="json")
        return m.JobInfo.model_validate(self.http.request("POST", "/v1/jobs", json=body).json())

    def jobs(self) -> list[m.JobInfo]:
        return [m.JobInfo.model_validate(j) for j in self.http.request("GET", "/v1/jobs").json()]

    def job(self, job_id: str) -> m.JobDetail:
        return m.JobDetail.model_validate(self.http.request("GET", f"/v1/jobs/{job_id}").json())

    def cancel(self, job_id: str) -> m.JobInfo:
        return m.JobInfo.model_validate(self.http.request("POST", f"/v1/jobs/{job_id}/cancel").json())

    def logs(self, job_id: str) -> list[m.JobEvent]:
        return [
            m.JobEvent.model_validate(e) for e in self.http.request("GET", f"/v1/jobs/{job_id}/logs").json()
        ]

    def checkpoint(self, job_id: str) -> bytes:
        return self.http.request("GET", f"/v1/jobs/{job_id}/checkpoint").content

    def offers(self) -> list[m.Offer]:
        return [m.Offer.model_validate(o) for o in self.http.request("GET", "/v1/offers").json()]

    def ledger(self) -> m.LedgerExport:
        return m.LedgerExport.model_validate(self.http.request("GET", "/v1/ledger/export").json())

    def proposals(self) -> list[m.ProposalInfo]:
        return [
            m.ProposalInfo.model_validate(p)
            for p in self.http.request("GET", "/v1/governance/proposals").json()
        ]

    def proposal(self, proposal_id: str) -> m.ProposalDetail:
        response = self.http.request("GET", f"/v1/governance/proposals/{proposal_id}")
        return m.ProposalDetail.model_validate(response.json())

    def parameters(self) -> list[m.ParameterInfo]:
        """The governable parameters in force now, with the changes scheduled."""
        response = self.http.request("GET", "/v1/governance/parameters")
        return [m.ParameterInfo.model_validate(p) for p in response.json()]
