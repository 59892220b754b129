"""Control-plane benchmark: heartbeats, lease grants and matching, on SQLite and PostgreSQL.

    .venv/bin/python bench/control_plane.py              # both backends (PostgreSQL if it answers)
    .venv/bin/python bench/control_plane.py --quick      # 400 nodes, 3-second phases, 200 queries
    .venv/bin/python bench/control_plane.py --backend sqlite --out bench/results/control_plane.json

Everything runs on loopback, each phase for a bounded time. Real coordinators are started as processes
(``gpuflex.localnet``); the load generator is ``--load-procs`` processes, each with ``--concurrency``
keep-alive connections, signing every request with its node's Ed25519 key as an agent does. It shares
the machine with the coordinators, so the numbers count it in the budget.

Per backend:

- ``heartbeats_per_s``: signed ``POST /v1/nodes/heartbeat`` answered 200, per second, over HTTP, one
  coordinator; ``heartbeats_per_s_2_replicas`` the same with the load split over two coordinators on
  one database (PostgreSQL only) and ``replica_speedup`` their ratio;
- ``storage_heartbeats_per_s``: heartbeats written by the storage layer alone
  (``registry.record_beats``, in batches as the coordinator's heartbeat writer commits them);
- ``leases_per_s``: lease grants per second over HTTP, every node asking at once for the task placed on
  it; ``double_assignments`` counts tasks or nodes holding more than one live lease afterwards (must be 0);
- ``cpu_heartbeats``, ``cpu_heartbeats_2_replicas``, ``cpu_leases``: for each HTTP phase, the CPU
  milliseconds per answered call spent by each part of the machine (the coordinators, the load
  processes, the PostgreSQL server if it runs here; Linux, read from /proc) and ``cores_busy``, the cores
  they kept busy together: below the machine's cores, something other than CPU held the phase back;
- ``replica_speedup_ceiling``: the most two replicas could give on this machine, if every core were busy
  at one replica's CPU cost per heartbeat (theirs, the load's and the database's), over one replica's rate;
- ``match_p50_ms_10k`` … ``match_p99_ms_100k``: placing a job's workers (random requirements, a tenth
  of the nodes busy) among 10,000 and 100,000 offers through ``market.index.OfferIndex``;
  ``linear_p50_ms_*`` the first ``--scans`` of the same queries by the linear scan
  (``market.matching.place_workers``) in the same run, ``index_speedup_*`` the ratio of their medians
  over those queries. Both must choose the same nodes, reasons included (checked on each).

The last line of stdout is ``{"results": [{…, "backend": "sqlite"}, {…, "backend": "postgresql"}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, make_url, select, text

from gpuflex.auth.signing import NodeKey
from gpuflex.client import Client, NodeClient
from gpuflex.coordinator.db import Lease, make_engine, make_sessionmaker
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.services import registry
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.market.index import OfferIndex
from gpuflex.market.matching import NodeOffer, Requirements, place_workers
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import scratch_postgres_database

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
HEARTBEAT = "/v1/nodes/heartbeat"
LEASE = "/v1/nodes/lease"


# -- the load generator: raw HTTP/1.1 keep-alive over asyncio, so the client costs little -------------


async def _call(reader, writer, host: str, key: NodeKey, path: str, body: bytes) -> int:
    headers = key.sign_request("POST", path, body)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(head.encode() + b"\r\n" + body)
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return int(status_line.split()[1])


async def _connection(
    url: str, keys: list[bytes], path: str, body: bytes, start_at: float, until: float, once: bool
):
    host = url.removeprefix("http://")
    address, port = host.split(":")
    reader, writer = await asyncio.open_connection(address, int(port))
    nodes = [NodeKey.from_hex(k.hex()) for k in keys]
    await asyncio.sleep(max(0.0, start_at - time.time()))  # every connection starts with the clock
    statuses: Counter[int] = Counter()
    i = 0
    while nodes and time.time() < until:
        statuses[await _call(reader, writer, host, nodes[i % len(nodes)], path, body)] += 1
        i += 1
        if once and i == len(nodes):
            break
    writer.close()
    return statuses


def _load_process(
    url: str, keys: list[bytes], path: str, body: bytes, start_at: float, until: float, conns: int, once, out
):
    async def main():
        shares = [keys[i::conns] for i in range(conns)]
        calls = [
            asyncio.ensure_future(_connection(url, s, path, body, start_at, until, once)) for s in shares if s
        ]
        await asyncio.sleep(max(0.0, start_at - time.time()))  # the connections open meanwhile
        began = time.process_time()
        answers = await asyncio.gather(*calls)
        return answers, time.process_time() - began

    answers, cpu_s = asyncio.run(main())
    out.put((sum(answers, Counter()), cpu_s))


@dataclass
class Load:
    """What a load run saw: answers by status, seconds from the start to the last answer, and
    the CPU seconds each part of the machine spent meanwhile (the load processes, the coordinators, the
    database server if it runs here)."""

    statuses: Counter[int]
    wall: float
    cpu_s: dict[str, float]

    @property
    def answered(self) -> int:
        return self.statuses[200]

    def rate(self) -> float:
        return round(self.answered / self.wall, 1)

    def cpu_s_per_call(self) -> float:
        """CPU seconds per answered call, every part together."""
        return sum(self.cpu_s.values()) / max(1, self.answered)

    def cpu(self) -> dict:
        """CPU milliseconds per answered call, by part, and the cores they kept busy together."""
        per_call = {part: round(1000 * s / max(1, self.answered), 3) for part, s in self.cpu_s.items()}
        return {"ms_per_call": per_call, "cores_busy": round(sum(self.cpu_s.values()) / self.wall, 2)}

    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)


def load(
    urls: list[str],
    keys: list[NodeKey],
    path: str,
    body: bytes,
    *,
    seconds: float,
    procs: int,
    conns: int,
    watch: dict[str, list[int]],
    once: bool = False,
) -> Load:
    """Run ``procs`` load processes (spread over ``urls``); each node's requests are sent by one of them.
    ``watch`` names the processes (by part) whose CPU time is counted while the load runs."""
    raw = [k.private_key.private_bytes_raw() for k in keys]
    out: multiprocessing.Queue = multiprocessing.Queue()
    start_at = time.time() + 1.0  # every process is up before the clock starts
    workers = [
        multiprocessing.Process(
            target=_load_process,
            args=(
                urls[i % len(urls)],
                raw[i::procs],
                path,
                body,
                start_at,
                start_at + seconds,
                conns,
                once,
                out,
            ),
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    before = {part: _cpu_s(pids) for part, pids in watch.items()}
    results = [out.get() for _ in workers]
    wall = time.time() - start_at
    cpu_s = {part: _cpu_s(pids) - before[part] for part, pids in watch.items()}
    for w in workers:
        w.join()
    cpu_s["load"] = sum(cpu for _, cpu in results)
    statuses = sum((counts for counts, _ in results), Counter())
    return Load(statuses, min(wall, seconds) if not once else wall, cpu_s)


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system, every thread) the processes have used so far; Linux (/proc)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone, or no /proc here
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _database_pids(database_url: str) -> list[int]:
    """The PostgreSQL server's processes, if it runs on this machine (they share its cores); else none."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql" or url.host not in (None, "127.0.0.1", "localhost", "::1"):
        return []
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "cmdline").read_bytes().startswith(b"postgres"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


# -- the network under test -----------------------------------------------------------------------------


@contextmanager
def database(backend: str, root: Path, postgres_url: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{root / 'bench.db'}"
        return
    with scratch_postgres_database(postgres_url, "gpuflex_bench") as url:
        yield url


def register(url: str, keys: list[NodeKey], cores: int) -> None:
    hardware = m.HardwareProfile(cpu_model="bench", cpu_cores=2, ram_gb=4, device="cpu", gpus=[])

    def one(i: int) -> None:
        core = i < cores
        client = NodeClient(url, keys[i])
        client.register(
            m.NodeRegister(
                name=f"n{i}",
                public_key=keys[i].public_key_hex,
                kind="core" if core else "community",
                core_token=CORE_TOKEN if core else None,
                price_per_hour=0.1 + (i % 50) / 100,
                hardware=hardware,
                benchmark=m.BenchmarkResult(tflops_fp32=1 + i % 7, mem_bandwidth_gbps=10),
            )
        )
        client.close()

    threads = [
        threading.Thread(target=lambda j=j: [one(i) for i in range(j, len(keys), 8)]) for j in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def heartbeats(urls: list[str], keys: list[NodeKey], args, watch: dict[str, list[int]]) -> Load:
    body = json.dumps({"leases": []}).encode()
    return load(
        urls,
        keys,
        HEARTBEAT,
        body,
        seconds=args.seconds,
        procs=args.load_procs,
        conns=args.concurrency,
        watch=watch,
    )


def storage_heartbeats(url: str, keys: list[NodeKey], seconds: float, batch: int = 256) -> float:
    """The storage layer alone: batches of heartbeats committed as the heartbeat writer commits them."""
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    ids = [k.node_id for k in keys]
    written, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        beats = [
            registry.Beat(ids[(written + i) % len(ids)], secrets.token_hex(16), ()) for i in range(batch)
        ]
        with sessions() as s, s.begin():
            registry.record_beats(s, beats, interval_s=2.0, now=time.time())
        written += batch
    rate = written / (time.perf_counter() - started)
    engine.dispose()
    return round(rate, 1)


def leases(
    url: str, database_url: str, keys: list[NodeKey], cores: int, args, watch: dict[str, list[int]]
) -> tuple[Load, int]:
    """Jobs for every node, placed by the reaper; then every node asks for its task at once."""
    consumer = Client(url)
    token = consumer.create_account("bench").token
    consumer = Client(url, token)
    consumer.deposit(1e6)
    workers = (len(keys) - cores) // cores
    dataset = consumer.upload(b"bench corpus " * 100)
    jobs = []
    for j in range(cores):
        spec = JobSpec.model_validate(
            {"name": f"b{j}", "resources": {"workers": workers}, "budget": 1000, "max_price_per_hour": 1}
        )
        jobs.append(consumer.submit(spec, dataset).id)
    deadline = time.time() + 120
    while not all(consumer.job(j).state == "scheduled" for j in jobs):
        assert time.time() < deadline, "the jobs were not placed within 2 minutes"
        time.sleep(0.5)
    storm = load(
        [url],
        keys,
        LEASE,
        b"",
        seconds=120,
        procs=args.load_procs,
        conns=args.concurrency,
        watch=watch,
        once=True,
    )
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as s:
        live = select(Lease.task_id, Lease.node_id).where(Lease.state == "active")
        rows = s.execute(live).all()
        double = (len(rows) - len({r.task_id for r in rows})) + (len(rows) - len({r.node_id for r in rows}))
    engine.dispose()
    return storm, double


def matching(sizes: list[int], queries: int, scans: int, seed: int = 0) -> dict[str, float]:
    """Index against linear scan, the same queries in the same run; both must choose the same nodes."""
    rng = random.Random(seed)
    regions = ["eu", "us", "asia", "local"]
    out = {}
    for n in sizes:
        offers = [
            NodeOffer(
                node_id=f"n{i:06d}",
                name=f"n{i}",
                kind="core" if rng.random() < 0.05 else "community",
                price_per_hour=round(rng.uniform(0.05, 3.0), 3),
                tflops=round(rng.uniform(0.5, 200), 1),
                vram_gb=rng.choice([0, 8, 16, 24, 48, 80]),
                gpus=("NVIDIA A100",) if rng.random() < 0.2 else ("NVIDIA RTX 4090",),
                region=rng.choice(regions),
                reliability=rng.uniform(0.3, 1.0),
                hours_left=None if rng.random() < 0.8 else rng.uniform(0, 48),
            )
            for i in range(n)
        ]
        index = OfferIndex(offers)
        busy = {o.node_id for o in rng.sample(offers, n // 10)}  # a tenth of the market runs tasks
        index.set_busy(busy)
        fast, slow, paired = [], [], []
        for _ in range(queries):
            req = Requirements(
                workers=rng.randint(1, 16),
                min_vram_gb=rng.choice([0, 0, 16, 24, 48]),
                min_tflops=rng.choice([0, 0, 10, 50]),
                accelerators=rng.choice([(), (), ("a100",)]),
                region=rng.choice([None, None, *regions]),
                max_price_per_hour=rng.choice([0.5, 1.0, 3.0]),
                min_core_workers=rng.choice([0, 0, 1]),
            )
            gc.collect()  # the last query's garbage is collected here, not inside the next timing
            gc.disable()
            t0 = time.perf_counter()
            got = index.place_workers(req, count=req.workers, exclude=set())
            fast.append((time.perf_counter() - t0) * 1000)
            if len(slow) < scans:  # the scan takes seconds at 100,000 offers: a sample of the queries
                t0 = time.perf_counter()
                want = place_workers(req, offers, count=req.workers, exclude=busy)
                slow.append((time.perf_counter() - t0) * 1000)
                assert got == want, f"the index chose differently from the scan for {req}"
                paired.append(fast[-1])
            gc.enable()
        label = f"{n // 1000}k"
        out[f"match_p50_ms_{label}"] = round(statistics.median(fast), 3)
        out[f"match_p99_ms_{label}"] = round(_p99(fast), 3)
        out[f"linear_p50_ms_{label}"] = round(statistics.median(slow), 3)
        out[f"index_speedup_{label}"] = round(statistics.median(slow) / statistics.median(paired), 1)
    return out


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def run_backend(backend: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp, database(backend, Path(tmp), args.postgres_url) as url:
        upgrade(url)
        # Nodes beat only while a heartbeat phase runs: a long interval keeps them online between phases.
        settings = {
            "GPUFLEX_LOG_FORMAT": "json",
            "GPUFLEX_REAPER_INTERVAL_S": "0.5",
            "GPUFLEX_HEARTBEAT_INTERVAL_S": "300",
        }
        keys = [NodeKey.generate() for _ in range(args.nodes)]
        cores = max(1, args.nodes // 100)
        result: dict = {}
        with LocalNetwork(Path(tmp) / "net", database_url=url, settings=settings) as net:
            first = net.start_coordinator()
            register(first, keys, cores)
            watch = {"coordinators": [net.coordinator.pid]}
            if database_pids := _database_pids(url):  # SQLite's work is the coordinators' own
                watch["database"] = database_pids
            one = heartbeats([first], keys, args, watch)
            result["heartbeats_per_s"], result["cpu_heartbeats"] = one.rate(), one.cpu()
            runs = [one]
            if backend == "postgresql":
                second = net.start_replica()
                watch["coordinators"] = [net.coordinator.pid, *(p.pid for p in net.replicas.values())]
                two = heartbeats([first, second], keys, args, watch)
                result["heartbeats_per_s_2_replicas"], result["cpu_heartbeats_2_replicas"] = (
                    two.rate(),
                    two.cpu(),
                )
                result["replica_speedup"] = round(two.rate() / one.rate(), 2)
                # if every core were busy at one replica's CPU cost per heartbeat (load and database included)
                ceiling = os.cpu_count() / one.cpu_s_per_call() / one.rate()
                result["replica_speedup_ceiling"] = round(ceiling, 2)
                runs.append(two)
            result["http_errors"] = sum(run.errors() for run in runs)
            storm, result["double_assignments"] = leases(first, url, keys, cores, args, watch)
            result["leases_per_s"], result["cpu_leases"] = storm.rate(), storm.cpu()
            result["lease_errors"] = storm.errors()
            if result["lease_errors"] or result["http_errors"]:
                statuses = [run.statuses for run in runs]
                print(f"heartbeats: {statuses}, leases: {storm.statuses}", file=sys.stderr)
        result["storage_heartbeats_per_s"] = storage_heartbeats(url, keys, args.seconds)
    result.update(matching([10_000, 100_000], args.queries, args.scans))
    result["backend"] = backend
    return result


def _postgres_up(url: str) -> bool:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 2})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3-second phases, 200 queries per size")
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--postgres-url", default=POSTGRES_URL, help="a server to make a scratch database on")
    parser.add_argument("--nodes", type=int, default=None, help="registered nodes [default: 1000, quick 400]")
    parser.add_argument(
        "--seconds", type=float, default=None, help="each heartbeat phase [default: 10, quick 3]"
    )
    parser.add_argument(
        "--queries", type=int, default=None, help="matching queries per size [1000, quick 200]"
    )
    parser.add_argument("--scans", type=int, default=None, help="of them, also by the scan [50, quick 20]")
    parser.add_argument("--load-procs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="connections per load process")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    args.nodes = args.nodes or (400 if args.quick else 1000)
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.queries = args.queries or (200 if args.quick else 1000)
    args.scans = args.scans or (20 if args.quick else 50)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    if "postgresql" in backends and not _postgres_up(args.postgres_url):
        if args.backend == "postgresql":
            sys.exit(f"PostgreSQL does not answer at {args.postgres_url}")
        print(f"PostgreSQL does not answer at {args.postgres_url}: SQLite only", file=sys.stderr)
        backends = ["sqlite"]
    results = []
    for backend in backends:
        result = run_backend(backend, args)
        print(json.dumps(result), file=sys.stderr)
        results.append(result)
    line = json.dumps({"results": results})
    if args.out:
        args.out.write_text(
            json.dumps({"results": results, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2)
            + "\n"
        )
    print(line)


if __name__ == "__main__":
    main()
