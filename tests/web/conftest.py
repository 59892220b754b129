"""A real coordinator app on a real database, served on a loopback port; its dashboard fetched over
HTTP like a browser would (cookies kept, redirects not followed so tests see them).

``Web.browser()`` is a fresh cookie jar (one person); ``running_job`` drives a job through the real
round protocol to the middle of round 1: round 0 and 1 published, one of two workers has contributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from gpuflex.client import Client, NodeClient, TaskClient
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import make_engine, make_sessionmaker
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage import LocalBlobStore
from gpuflex.testing import Clock, register_node, serve

from .helpers import model_blob

CORE_TOKEN = "core-secret"


@dataclass
class Web:
    url: str
    app: FastAPI
    ctx: CoordinatorContext
    clock: Clock

    def browser(self) -> httpx.Client:
        """A separate visitor with its own cookies."""
        return httpx.Client(base_url=self.url, follow_redirects=False, timeout=30)

    def consumer(self, name: str, deposit: float = 0) -> tuple[Client, str]:
        token = Client(self.url).create_account(name).token
        client = Client(self.url, token)
        if deposit:
            client.deposit(deposit)
        return client, token

    def node(self, name: str, *, price: float = 0.1, core: bool = False) -> NodeClient:
        return register_node(self.url, name, core_token=CORE_TOKEN if core else None, price=price, tflops=1.5)

    def task(self, grant: m.LeaseGrant) -> TaskClient:
        return TaskClient(self.url, grant.task_token, retry_for_s=0)

    def sign_in(self, token: str) -> httpx.Client:
        browser = self.browser()
        response = browser.post("/dashboard/signin", data={"token": token, "next": "/dashboard/jobs"})
        assert response.status_code == 303, response.text
        return browser


@pytest.fixture
def web(database_url, tmp_path):
    upgrade(database_url)
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        database_url=database_url,
        core_token=CORE_TOKEN,
        reaper_interval_s=3600,
        dashboard_secret="test-dashboard-secret",
    )
    engine = make_engine(database_url)
    clock = Clock()
    ctx = CoordinatorContext(
        settings, engine, make_sessionmaker(engine), LocalBlobStore(tmp_path / "blobs"), clock
    )
    app = create_app(ctx=ctx)
    try:
        with serve(app) as url:
            yield Web(url, app, ctx, clock)
    finally:
        engine.dispose()


@dataclass
class RunningJob:
    job_id: str
    alice: Client
    alice_token: str
    core: NodeClient
    workers: list[NodeClient]
    worker_tasks: list[TaskClient]


def _contribute(task: TaskClient, round_: int, loss: float) -> None:
    delta = task.put_blob(f"delta {round_} {loss}".encode() * 50)
    msg = m.ContributionSubmit(round=round_, delta=delta, tokens=512, steps=5, train_loss=loss)
    assert task.submit_contribution(msg)


@pytest.fixture
def running_job(web: Web) -> RunningJob:
    alice, token = web.consumer("alice", deposit=10)
    core = web.node("core-1", core=True, price=0.4)
    workers = [web.node(f"box-{i}", price=0.1 + i / 100) for i in range(2)]
    spec = JobSpec.model_validate(
        {"name": "tiny-gpt", "resources": {"workers": 2}, "budget": 2.0, "training": {"rounds": 5}}
    )
    job = alice.submit(spec, alice.upload(b"corpus " * 2000))
    aggregator = web.task(core.lease())
    tasks = [web.task(w.lease()) for w in workers]
    state0 = aggregator.put_blob(model_blob(0))
    aggregator.publish_round(m.RoundPublish(round=0, state_hash="a" * 64, checkpoint=state0, val_loss=5.5))
    for i, task in enumerate(tasks):
        _contribute(task, 0, 5.0 - i / 10)
    update = aggregator.put_blob(b"aggregated update" * 40)
    published = {"state_hash": "b" * 64, "update": update, "val_loss": 4.5, "train_loss": 4.95}
    aggregator.publish_round(m.RoundPublish(round=1, contributions=2, **published))
    _contribute(tasks[0], 1, 4.2)
    tasks[1].log("<img src=x onerror=alert(1)> sneaky log line")
    return RunningJob(job.id, alice, token, core, workers, tasks)
