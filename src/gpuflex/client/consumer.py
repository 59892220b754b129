"""``Client``: what a consumer does — sign up, fund a wallet, submit and follow jobs, audit the ledger,
read the network's governance; with the operator's token, it also passes verdicts (``slash``)."""

from __future__ import annotations

from gpuflex.client import direct
from gpuflex.client.http import HttpSession
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec


class Client:
    """``Client(url, token)``. ``Client(url)``, with no token, creates an account and reads the network's
    public record: offers, the journal (``ledger``), verdicts (``slashes``) and governance."""

    def __init__(
        self, url: str, token: str | None = None, *, retry_for_s: float = 0.0, transport=None, ca=None
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = HttpSession(url, headers=headers, retry_for_s=retry_for_s, transport=transport, ca=ca)

    def close(self) -> None:
        self.http.close()

    def create_account(self, name: str) -> m.AccountCreated:
        body = m.AccountCreate(name=name).model_dump()
        return m.AccountCreated.model_validate(self.http.request("POST", "/v1/accounts", json=body).json())

    def me(self) -> m.AccountInfo:
        """Whose token this is, and the wallet's balance."""
        return m.AccountInfo.model_validate(self.http.request("GET", "/v1/accounts/me").json())

    def balance(self) -> m.Balance:
        return m.Balance.model_validate(self.http.request("GET", "/v1/wallet").json())

    def deposit(self, amount: float) -> m.Balance:
        body = m.Deposit(amount=amount).model_dump()
        return m.Balance.model_validate(self.http.request("POST", "/v1/wallet/deposit", json=body).json())

    def upload(self, data: bytes) -> str:
        return direct.upload(self.http, data)

    def missing_blobs(self, keys: list[str]) -> m.MissingBlobs:
        """Which of ``keys`` the blob store lacks (asked ``MAX_BLOB_KEYS`` at a time), and its blob limit."""
        missing: list[str] = []
        limit = 0
        for i in range(0, max(len(keys), 1), m.MAX_BLOB_KEYS):
            body = m.BlobKeys(keys=keys[i : i + m.MAX_BLOB_KEYS]).model_dump()
            answer = m.MissingBlobs.model_validate(
                self.http.request("POST", "/v1/blobs/missing", json=body).json()
            )
            missing += answer.keys
            limit = answer.max_blob_bytes
        return m.MissingBlobs(keys=missing, max_blob_bytes=limit)

    def submit(
        self,
        spec: JobSpec,
        dataset: str | None = None,
        recipe_code: str | None = None,
        sealed_key: str | None = None,
    ) -> m.JobInfo:
        """Submit a job whose inputs (dataset, user recipe file) are already uploaded; ``sealed_key``: an
        encrypted job's data key sealed to the consumer."""
        body = _submission(spec, dataset, recipe_code, sealed_key)
        return m.JobInfo.model_validate(self.http.request("POST", "/v1/jobs", json=body).json())

    def check_submit(
        self,
        spec: JobSpec,
        dataset: str | None = None,
        recipe_code: str | None = None,
        sealed_key: str | None = None,
    ) -> None:
        """Raise what ``submit`` would refuse, before the job's model and data are uploaded (only a prepared
        dataset's manifest need be; ``model.from`` only sized); nothing is written or spent."""
        body = _submission(spec, dataset, recipe_code, sealed_key)
        self.http.request("POST", "/v1/jobs/check", json=body)

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

    def verdicts(self, job_id: str) -> list[m.Verdict]:
        """What verification found on the job's contributions, newest first."""
        rows = self.http.request("GET", f"/v1/jobs/{job_id}/verdicts").json()
        return [m.Verdict.model_validate(v) for v in rows]

    def job_keys(self, job_id: str) -> m.JobKeys:
        """An encrypted job's data key sealed to us, and the live leases waiting for theirs."""
        return m.JobKeys.model_validate(self.http.request("GET", f"/v1/jobs/{job_id}/keys").json())

    def grant_key(self, job_id: str, grant: m.KeyGrant) -> None:
        self.http.request("POST", f"/v1/jobs/{job_id}/keys", json=grant.model_dump())

    def checkpoint(self, job_id: str) -> bytes:
        response = self.http.request("GET", f"/v1/jobs/{job_id}/checkpoint")
        if response.is_redirect:
            digest = response.headers["X-Content-SHA256"]
            return direct.fetch(response.headers["Location"], digest, retry_for_s=self.http.retry_for_s)
        return response.content

    def deploy(self, spec: DeploymentSpec) -> m.DeploymentInfo:
        """Create a deployment whose model (``model.from``'s directory) is already uploaded."""
        body = m.DeploymentCreate(spec=spec).model_dump(mode="json")
        return m.DeploymentInfo.model_validate(self.http.request("POST", "/v1/deployments", json=body).json())

    def check_deploy(self, spec: DeploymentSpec) -> None:
        """Raise what ``deploy`` would refuse, before ``model.from``'s directory is uploaded (only sized);
        nothing is written or spent."""
        body = m.DeploymentCreate(spec=spec).model_dump(mode="json")
        self.http.request("POST", "/v1/deployments/check", json=body)

    def deployments(self) -> list[m.DeploymentInfo]:
        rows = self.http.request("GET", "/v1/deployments").json()
        return [m.DeploymentInfo.model_validate(d) for d in rows]

    def deployment(self, deployment_id: str) -> m.DeploymentDetail:
        response = self.http.request("GET", f"/v1/deployments/{deployment_id}")
        return m.DeploymentDetail.model_validate(response.json())

    def deployment_logs(self, deployment_id: str) -> list[m.JobEvent]:
        rows = self.http.request("GET", f"/v1/deployments/{deployment_id}/logs").json()
        return [m.JobEvent.model_validate(e) for e in rows]

    def scale(self, deployment_id: str, replicas: int) -> m.DeploymentInfo:
        body = m.DeploymentScale(replicas=replicas).model_dump()
        response = self.http.request("POST", f"/v1/deployments/{deployment_id}/scale", json=body)
        return m.DeploymentInfo.model_validate(response.json())

    def stop_deployment(self, deployment_id: str) -> m.DeploymentInfo:
        """End a deployment; what its budget did not pay for goes back to the wallet."""
        response = self.http.request("POST", f"/v1/deployments/{deployment_id}/stop")
        return m.DeploymentInfo.model_validate(response.json())

    def create_key(
        self, deployment_id: str, holder: str | None = None, price_in: float = 0.0, price_out: float = 0.0
    ) -> m.DeploymentKeyCreated:
        """An API key scoped to the deployment, for OpenAI clients; its secret is shown this once. Made
        for the account named ``holder``, that account pays the prices (credits per million input and
        output tokens) to this one, and only it gets the secret (``claim_key``)."""
        body = m.DeploymentKeyCreate(holder=holder, price_in=price_in, price_out=price_out)
        response = self.http.request("POST", f"/v1/deployments/{deployment_id}/keys", json=body.model_dump())
        return m.DeploymentKeyCreated.model_validate(response.json())

    def claim_key(self, key_id: str) -> m.DeploymentKeyCreated:
        """The secret of a key another account's deployment made for this account; shown this once."""
        response = self.http.request("POST", f"/v1/deployments/keys/{key_id}/claim")
        return m.DeploymentKeyCreated.model_validate(response.json())

    def offers(self, query: str = "", order: str = "") -> list[m.Offer]:
        """The nodes on offer that ``query`` matches (``gpuflex.market.query``: e.g. ``"vram>=16
        price<=0.5"``; empty: all), sorted by ``order`` (e.g. ``"price,-reliability"``)."""
        params = {k: v for k, v in (("q", query), ("order", order)) if v}
        response = self.http.request("GET", "/v1/offers", params=params)
        return [m.Offer.model_validate(o) for o in response.json()]

    def quote(self, spec: JobSpec) -> m.Quote:
        """What a job would cost and take if submitted now; nothing is spent."""
        body = spec.model_dump(mode="json")
        return m.Quote.model_validate(self.http.request("POST", "/v1/quote", json=body).json())

    def ledger(self) -> m.LedgerExport:
        return m.LedgerExport.model_validate(self.http.request("GET", "/v1/ledger/export").json())

    def slashes(self) -> list[m.SlashRecord]:
        """Every verdict's penalty: who was slashed, how much, and the evidence."""
        return [m.SlashRecord.model_validate(s) for s in self.http.request("GET", "/v1/slashes").json()]

    def slash(self, msg: m.SlashRequest) -> m.SlashRecord:
        """A verdict (the operator's token only): take a node's stake, and its held pay for a job."""
        response = self.http.request("POST", "/v1/slashes", json=msg.model_dump())
        return m.SlashRecord.model_validate(response.json())

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


def _submission(
    spec: JobSpec, dataset: str | None, recipe_code: str | None, sealed_key: str | None
) -> dict[str, object]:
    msg = m.JobSubmit(spec=spec, dataset=dataset, recipe_code=recipe_code, sealed_key=sealed_key)
    return msg.model_dump(mode="json")
