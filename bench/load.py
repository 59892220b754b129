"""Load test: many simulated agents heartbeating and leasing against one real coordinator on loopback.

    python bench/load.py                                  # 1,000 agents for 2 minutes on SQLite
    python bench/load.py --db postgresql --seconds 60     # PostgreSQL (a fresh database, dropped after)
    python bench/load.py --agents 200 --seconds 20        # a quick look

The coordinator is the real one (``gpuflex coordinator serve`` as a process, default settings, rate
limits included). Each simulated agent does over real HTTP, every request signed with its own Ed25519
key, what ``gpuflex.agent.daemon`` does: it registers; heartbeats at the interval the coordinator hands
out, carrying the lease it holds; while idle, asks for a lease when a heartbeat says a task is placed on
it (and, unasked, every ``lease_poll_s``); holds a granted lease for ``hold_s`` and then reports it
``released`` (the task goes back to the market and is leased again); and drops at once a lease a
heartbeat says was revoked. A tenth of the agents are core nodes
(aggregators go there); a consumer keeps one job of 4 workers open per 10 agents, so there is work.

Errors are transport failures and any status outside the protocol's own answers: 2xx everywhere, and
a 409 to a report whose lease was revoked between a heartbeat and the report (``stale_reports``, not
an error: the agent learns of it so). The last stdout line is one JSON object; bench/results/load.json
(or ``--out``) holds the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gpuflex.auth.signing import NodeKey
from gpuflex.client import Client
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import scratch_postgres_database

RESULTS = Path(__file__).parent / "results"
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
LEASE_POLL_S = 30.0  # AgentConfig.lease_poll_s: how often an idle agent asks for work unasked
TICK_S = 0.5  # how often the lease loop looks at its flag and its lease, as the daemon's loop does
HOLD_S = 10.0  # how long a simulated agent keeps a lease before handing it back
AGENTS_PER_JOB = 10
WORKERS_PER_JOB = 4


@dataclass
class Stats:
    latency_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)
    granted: int = 0
    revoked: int = 0
    stale_reports: int = 0

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.first_errors) < 20:
            self.first_errors.append(f"{kind}: {what}")


class SimulatedAgent:
    def __init__(self, http: httpx.AsyncClient, stats: Stats, index: int, core: bool):
        self.http = http
        self.stats = stats
        self.key = NodeKey.generate()
        self.index = index
        self.core = core
        self.interval_s = 2.0
        self.held: m.LeaseGrant | None = None
        self.held_until = 0.0
        self.work_waiting = True  # set by a heartbeat that says a task is placed on it, and at the start
        self.asked_at = 0.0

    async def call(self, kind: str, path: str, body: dict | None = None) -> httpx.Response | None:
        content = b"" if body is None else json.dumps(body).encode()
        headers = self.key.sign_request("POST", path, content)
        if body is not None:
            headers["Content-Type"] = "application/json"
        started = time.perf_counter()
        try:
            response = await self.http.post(path, content=content, headers=headers)
        except httpx.HTTPError as err:
            self.stats.error(kind, f"{type(err).__name__}: {err}")
            return None
        self.stats.latency_s[kind].append(time.perf_counter() - started)
        if response.status_code == 409 and kind == "report":
            self.stats.stale_reports += 1
        elif not response.is_success:
            self.stats.error(kind, f"{response.status_code} {response.text[:200]}")
            return None
        return response

    async def register(self) -> bool:
        msg = m.NodeRegister(
            name=f"load-{self.index}",
            public_key=self.key.public_key_hex,
            kind="core" if self.core else "community",
            core_token=CORE_TOKEN if self.core else None,
            price_per_hour=0.01,
            hardware=m.HardwareProfile(cpu_model="simulated", cpu_cores=2, ram_gb=4),
            benchmark=m.BenchmarkResult(tflops_fp32=1.0 + self.index % 7, mem_bandwidth_gbps=10),
        )
        response = await self.call("register", "/v1/nodes/register", msg.model_dump(mode="json"))
        if response is not None:
            self.interval_s = m.NodeRegistered.model_validate(response.json()).heartbeat_interval_s
        return response is not None

    async def heartbeats(self, until: float) -> None:
        await asyncio.sleep(random.uniform(0, self.interval_s))  # agents started at different moments
        while time.monotonic() < until:
            held = [m.LeaseHeld(lease_id=self.held.lease_id, epoch=self.held.epoch)] if self.held else []
            response = await self.call(
                "heartbeat", "/v1/nodes/heartbeat", m.Heartbeat(leases=held).model_dump()
            )
            if response is not None:
                ack = m.HeartbeatAck.model_validate(response.json())
                self.interval_s = ack.heartbeat_interval_s
                if self.held and self.held.lease_id in ack.revoked:
                    self.stats.revoked += 1
                    self.held = None
                self.work_waiting = self.work_waiting or ack.work
            await asyncio.sleep(self.interval_s)

    async def work(self, until: float) -> None:
        await asyncio.sleep(random.uniform(0, TICK_S))
        while time.monotonic() < until:
            if self.held is None and (self.work_waiting or time.monotonic() - self.asked_at >= LEASE_POLL_S):
                self.work_waiting, self.asked_at = False, time.monotonic()
                response = await self.call("lease", "/v1/nodes/lease")
                if response is not None and response.status_code == 200:
                    self.held = m.LeaseGrant.model_validate(response.json())
                    self.held_until = time.monotonic() + HOLD_S
                    self.stats.granted += 1
            elif self.held is not None and time.monotonic() >= self.held_until:
                grant, self.held = self.held, None
                report = m.LeaseReport(epoch=grant.epoch, outcome="released", detail="load test")
                await self.call("report", f"/v1/nodes/leases/{grant.lease_id}/report", report.model_dump())
                self.work_waiting = True  # as the daemon does once its task is over: ask for the next
            await asyncio.sleep(TICK_S)


def _client(url: str) -> httpx.AsyncClient:
    # up to two calls in flight (its heartbeat thread and its lease loop), as the daemon has
    return httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=2), timeout=60)


def _percentiles(samples: list[float]) -> dict[str, float]:
    if len(samples) < 2:
        return {"count": len(samples), "p50_ms": None, "p99_ms": None}
    cuts = statistics.quantiles(samples, n=100)
    return {"count": len(samples), "p50_ms": round(cuts[49] * 1000, 2), "p99_ms": round(cuts[98] * 1000, 2)}


async def _run_agents(url: str, agents: int, seconds: float) -> tuple[Stats, float]:
    stats = Stats()
    # each its own client, as each agent is: one pool of 2,000 connections made httpx's pool, which scans
    # its connections for every request, the bottleneck (py-spy: four fifths of this process's time)
    async with AsyncExitStack() as clients:
        fleet = [
            SimulatedAgent(await clients.enter_async_context(_client(url)), stats, i, core=i % 10 == 0)
            for i in range(agents)
        ]
        gate = asyncio.Semaphore(50)

        async def register(agent: SimulatedAgent) -> bool:
            async with gate:
                return await agent.register()

        answered = await asyncio.gather(*map(register, fleet))
        registered = [agent for agent, ok in zip(fleet, answered, strict=True) if ok]
        started = time.monotonic()
        until = started + seconds
        await asyncio.gather(*(a.heartbeats(until) for a in registered), *(a.work(until) for a in registered))
        return stats, time.monotonic() - started


def _open_jobs(url: str, jobs: int) -> None:
    client = Client(url, Client(url).create_account(f"load-{secrets.token_hex(3)}").token)
    client.deposit(1000)
    dataset = client.upload(b"load test text " * 100)
    spec = {"resources": {"workers": WORKERS_PER_JOB}, "budget": 5, "max_price_per_hour": 1.0}
    for i in range(jobs):
        client.submit(JobSpec.model_validate({"name": f"load-{i}", **spec}), dataset)


@contextmanager
def _database(kind: str, server_url: str) -> Iterator[str | None]:
    """None (SQLite in the coordinator's data dir), or a fresh PostgreSQL database dropped afterwards."""
    if kind == "sqlite":
        yield None
        return
    with scratch_postgres_database(server_url, "gpuflex_load") as url:
        yield url


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES, help="server to make the database on")
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args(argv)

    with (
        tempfile.TemporaryDirectory(prefix="gpuflex-load-") as root,
        _database(args.db, args.postgres_url) as database_url,
        LocalNetwork(Path(root), database_url=database_url) as net,
    ):
        url = net.start_coordinator()
        _open_jobs(url, max(1, args.agents // AGENTS_PER_JOB))
        stats, wall_s = asyncio.run(_run_agents(url, args.agents, args.seconds))
        coordinator_log = net.log_tail("coordinator", 2000)

    requests = sum(len(v) for v in stats.latency_s.values())
    result = {
        "backend": args.db,
        "agents": args.agents,
        "seconds": round(wall_s, 1),
        "requests": requests,
        "requests_per_s": round(requests / wall_s, 1),
        "errors": sum(stats.errors.values()),
        "errors_by_kind": dict(stats.errors),
        "first_errors": stats.first_errors,
        "leases_granted": stats.granted,
        "leases_revoked": stats.revoked,
        "stale_reports": stats.stale_reports,
        "latency": {kind: _percentiles(samples) for kind, samples in sorted(stats.latency_s.items())},
    }
    if result["errors"]:
        result["coordinator_log_tail"] = coordinator_log
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("first_errors", "coordinator_log_tail")}
    print(json.dumps(summary))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
