"""A real coordinator app on a real database (SQLite, and PostgreSQL when reachable), served by
uvicorn on a loopback port and driven over real HTTP through the SDK. It runs in a thread of the
test process so the test can advance its clock (real time plus an offset)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gpuflex.auth.signing import NodeKey
from gpuflex.client import Client, NodeClient, TaskClient
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.context import CoordinatorContext
from gpuflex.coordinator.db import make_engine, make_sessionmaker
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol import messages as m
from gpuflex.storage import BlobStore, LocalBlobStore
from gpuflex.testing import Clock, register_node, serve

CORE_TOKEN = "core-secret"


@dataclass
class Harness:
    url: str
    http: httpx.Client  # raw requests, for what the SDK would never send
    ctx: CoordinatorContext
    clock: Clock

    def consumer(self, name: str, deposit: float = 0) -> Client:
        token = Client(self.url).create_account(name).token
        client = Client(self.url, token)
        if deposit:
            client.deposit(deposit)
        return client

    def node(
        self,
        name: str,
        *,
        price: float = 0.1,
        core: bool = False,
        tflops: float = 1.0,
        region: str = "local",
        gpu: m.GpuInfo | None = None,
        available_hours: float | None = None,
        key: NodeKey | None = None,
        private_data: Sequence[m.PrivateDataset] = (),
        consumers: Sequence[str] = (),
        sealing_key: X25519PrivateKey | None = None,
    ) -> NodeClient:
        return register_node(
            self.url,
            name,
            core_token=CORE_TOKEN if core else None,
            price=price,
            tflops=tflops,
            region=region,
            gpu=gpu,
            available_hours=available_hours,
            key=key,
            private_data=private_data,
            consumers=consumers,
            sealing_key=sealing_key,
        )

    def task(self, grant: m.LeaseGrant) -> TaskClient:
        return TaskClient(self.url, grant.task_token, retry_for_s=0)


@contextmanager
def running_coordinator(
    database_url: str, data_dir: Path, *, blobs: BlobStore | None = None, **settings: object
) -> Iterator[Harness]:
    """A migrated database and the coordinator on it, served on loopback, its blobs in ``blobs`` (default:
    a directory); ``settings`` override the test defaults below."""
    upgrade(database_url)
    settings = CoordinatorSettings(
        **{
            "data_dir": data_dir,
            "database_url": database_url,
            "core_token": CORE_TOKEN,
            "lease_ttl_s": 15,
            "heartbeat_interval_s": 2,
            "heartbeat_misses": 3,
            "liveness_cache_s": 0,  # tests move the clock and change the rules between calls
            "max_request_bytes": 64 * 1024,
            "max_blob_bytes": 256 * 1024,
            "reaper_interval_s": 3600,
            "lease_placement_interval_s": 0,  # no reaper: every lease request may place (tests place so)
            "platform_fee_bps": 1000,
            # short: a node's signature outlives no more than a minute of clock
            "governance_voting_period_s": 10,
            **settings,
        }
    )
    engine = make_engine(database_url)
    clock = Clock()
    blobs = blobs or LocalBlobStore(data_dir / "blobs")
    ctx = CoordinatorContext(settings, engine, make_sessionmaker(engine), blobs, clock)
    try:
        with serve(create_app(ctx=ctx)) as url, httpx.Client(base_url=url) as http:
            yield Harness(url, http, ctx, clock)
    finally:
        engine.dispose()


@pytest.fixture
def coordinator(database_url, tmp_path):
    with running_coordinator(database_url, tmp_path) as harness:
        yield harness
