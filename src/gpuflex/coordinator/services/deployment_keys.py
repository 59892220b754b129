"""API keys scoped to one deployment: what an OpenAI client sends the gateway instead of its owner's
account token, so a key handed to an application reaches that deployment and nothing else.

Only a key's sha256 is kept (as an account token's). Each request served under a key counts on its row
(requests, prompt and completion tokens): its owner sees them on ``deployment show``.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpuflex.auth.tokens import new_deployment_key, token_hash
from gpuflex.coordinator.db import DeploymentKey, Job, JobEvent, new_id
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.errors import Conflict, Unauthorized
from gpuflex.protocol import messages as m


def create(session: Session, deployment: Job, now: float) -> m.DeploymentKeyCreated:
    """A new key of ``deployment`` (its owner's, already checked), with the secret shown this once."""
    if deployment.state not in OPEN_JOB_STATES:
        raise Conflict(f"deployment {deployment.id} has ended ({deployment.state}): it takes no new key")
    secret = new_deployment_key()
    key = DeploymentKey(
        id=new_id("k"),
        deployment_id=deployment.id,
        token_hash=token_hash(secret),
        created_at=now,
        requests=0,
        prompt_tokens=0,
        completion_tokens=0,
    )
    session.add(key)
    session.add(JobEvent(job_id=deployment.id, at=now, message=f"API key {key.id} created"))
    return m.DeploymentKeyCreated(**usage(key).model_dump(), deployment_id=deployment.id, key=secret)


def authenticate(session: Session, secret: str) -> DeploymentKey:
    key = session.scalars(select(DeploymentKey).where(DeploymentKey.token_hash == token_hash(secret))).first()
    if key is None:
        raise Unauthorized("unknown API key")
    return key


def count(session: Session, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """One request served under the key: added in the database, so concurrent requests all count."""
    session.execute(
        update(DeploymentKey)
        .where(DeploymentKey.id == key_id)
        .values(
            requests=DeploymentKey.requests + 1,
            prompt_tokens=DeploymentKey.prompt_tokens + prompt_tokens,
            completion_tokens=DeploymentKey.completion_tokens + completion_tokens,
        )
    )


def of(session: Session, deployment: Job) -> list[m.KeyUsage]:
    query = select(DeploymentKey).where(DeploymentKey.deployment_id == deployment.id)
    return [usage(k) for k in session.scalars(query.order_by(DeploymentKey.created_at, DeploymentKey.id))]


def usage(key: DeploymentKey) -> m.KeyUsage:
    return m.KeyUsage(
        id=key.id,
        created_at=key.created_at,
        requests=key.requests,
        prompt_tokens=key.prompt_tokens,
        completion_tokens=key.completion_tokens,
    )
