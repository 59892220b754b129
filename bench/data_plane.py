"""The data plane: blob bytes carried by the coordinator (the filesystem store) against moved straight
between nodes and an object store (a local S3 server), side by side in one run.

    python bench/data_plane.py           # a 512 MiB model, 4 nodes, a 3-round job
    python bench/data_plane.py --quick   # a 2-round job: under 6 minutes on 2 cores

For each store, a real coordinator (SQLite) on loopback:

1. a consumer uploads a 512 MiB model (16 blobs of 32 MiB, as `storage.bundles` cuts a large file);
2. four registered nodes, each its own process, fetch all of it at once (`NodeClient.get_blob`, which
   follows a presigned URL where the store signs one);
3. a short job runs its rounds on a core agent and two community agents (real processes, real training);
4. on the filesystem store, one node's download is cut off at half a blob and resumed.

On S3 every call to the coordinator (the consumer's, the nodes', the agents' and their tasks') goes
through a counting TCP proxy, so ``coordinator_bytes_per_blob_byte`` counts every byte the coordinator
sent or received (HTTP headers and control traffic included) over the blob bytes moved (what it signed
URLs for). On the filesystem store the nodes fetch without the proxy, so it does not slow them; the
coordinator's RSS is sampled every 20 ms while they pull (``coordinator_peak_rss_mb``: the peak above
its RSS before the first upload). ``fetch_throughput_ratio`` is the four nodes' aggregate fetch rate
from S3 over the one through the coordinator. ``resume_saved_bytes``: the share of a cut blob the
resumed request did not send again. The simulator's coordinator egress for the ``llm-8b`` job mix at
10k nodes comes from ``sim_scale.run``, relayed and direct. Writes ``bench/results/data_plane[-quick].json``
and prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from gpuflex.auth.signing import NodeKey
from gpuflex.cli.inputs import upload_inputs
from gpuflex.client import Client
from gpuflex.client.node import NodeClient
from gpuflex.localnet import CORE_TOKEN, LocalNetwork, free_port
from gpuflex.protocol import messages as m
from gpuflex.testing import blob_bytes, small_job, wait_for, write_corpus

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20
PART_BYTES = 32 * MIB
PARTS = 16  # 512 MiB
NODES = 4


class CountingProxy:
    """A loopback TCP proxy in front of the coordinator, counting the bytes each way. With ``cut_after``,
    the first connection is closed once that many bytes have gone back to the client."""

    def __init__(self, target_port: int, *, cut_after: int | None = None):
        self.target_port, self.cut_after = target_port, cut_after
        self.up = self.down = 0
        self.down_by_connection: list[int] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                index = len(self.down_by_connection)
                self.down_by_connection.append(0)
            cut = self.cut_after if index == 0 else None
            threading.Thread(target=self._pump, args=(client, upstream, None, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, index, cut), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, index: int | None, cut: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(256 * 1024):
                if cut is not None:
                    data = data[: cut - sent]
                sink.sendall(data)
                sent += len(data)
                with self._lock:
                    if index is None:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                        self.down_by_connection[index] += len(data)
                if cut is not None and sent >= cut:
                    break
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    @property
    def total(self) -> int:
        return self.up + self.down

    def close(self) -> None:
        self._listener.close()


class RssSampler:
    """A process's resident memory, sampled every ``every_s`` on a thread: its peak while running."""

    def __init__(self, pid: int, every_s: float = 0.02):
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(self.every_s)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def register_nodes(url: str, count: int) -> list[str]:
    """``count`` community nodes registered with the coordinator; their private keys (hex)."""
    keys = []
    for i in range(count):
        private = secrets.token_hex(32)  # a raw Ed25519 key, which the fetching processes rebuild
        key = NodeKey.from_hex(private)
        node = NodeClient(url, key)
        node.register(
            m.NodeRegister(
                name=f"fetcher-{i}",
                public_key=key.public_key_hex,
                kind="community",
                price_per_hour=0.01,
                hardware=m.HardwareProfile(cpu_model="bench", cpu_cores=1, ram_gb=4),
                benchmark=m.BenchmarkResult(tflops_fp32=1.0, mem_bandwidth_gbps=10),
            )
        )
        node.close()
        keys.append(private)
    return keys


def leave(url: str, keys: list[str]) -> None:
    """The fetching nodes leave the market, so that the job is not placed on nodes that take no work."""
    for key in keys:
        node = NodeClient(url, NodeKey.from_hex(key))
        node.leave()
        node.close()


def fetch_all(url: str, key_hex: str, digests: list[str]) -> int:
    """One node's fetch of every blob (a process of its own); the bytes it got, each checked."""
    node = NodeClient(url, NodeKey.from_hex(key_hex), retry_for_s=30)
    try:
        return sum(len(node.get_blob(d)) for d in digests)
    finally:
        node.close()


def fetch_rate(url: str, keys: list[str], digests: list[str]) -> dict:
    """Every node fetches every blob at once; the aggregate rate over the time the last one took."""
    with multiprocessing.get_context("spawn").Pool(len(keys)) as pool:
        started = time.perf_counter()
        got = pool.starmap(fetch_all, [(url, k, digests) for k in keys])
        took = time.perf_counter() - started
    return {"bytes": sum(got), "seconds": round(took, 2), "mb_per_s": round(sum(got) / took / 1e6, 1)}


def upload_model(client: Client) -> tuple[list[str], float]:
    """The model's parts uploaded; their keys and the seconds it took."""
    parts = [os.urandom(PART_BYTES) for _ in range(PARTS)]
    started = time.perf_counter()
    digests = [client.upload(part) for part in parts]
    return digests, time.perf_counter() - started


def run_job(net: LocalNetwork, client: Client, url: str, root: Path, rounds: int) -> float:
    """A short job on a core agent and two community agents that talk to ``url``; its seconds."""
    net.start_agent("core", price=0.3, core=True, url=url, extra=["--core-token", CORE_TOKEN])
    for i in range(2):
        net.start_agent(f"community-{i}", price=0.1, url=url)
    wait_for(lambda: sum(o.state == "online" for o in client.offers()) == 3, 120, "the agents to register")
    write_corpus(root / "corpus")
    spec = small_job(root / "corpus", workers=2, rounds=rounds)
    started = time.perf_counter()
    job_id = client.submit(spec, **upload_inputs(client, spec)).id
    job = wait_for(lambda: (j := client.job(job_id)).state in ("completed", "failed") and j, 600, "the job")
    if job.state != "completed":
        raise RuntimeError(f"the job {job_id} {job.state}: {job.reason}")
    client.checkpoint(job_id)  # the consumer takes the result home
    return time.perf_counter() - started


def filesystem(root: Path, rounds: int) -> dict:
    with LocalNetwork(root) as net:
        url = net.start_coordinator()
        pid = net.coordinator.pid
        idle = rss_bytes(pid)
        client = Client(url, Client(url).create_account("bench").token, retry_for_s=60)
        client.deposit(50)
        digests, upload_s = upload_model(client)
        keys = register_nodes(url, NODES)
        with RssSampler(pid) as rss:
            fetched = fetch_rate(url, keys, digests)
        resume = resumed_download(net, keys[0], digests[0])
        leave(url, keys)
        job_s = run_job(net, client, url, root, rounds)
        carried = blob_bytes(url)
    return {
        "upload_mb_per_s": round(PARTS * PART_BYTES / upload_s / 1e6, 1),
        "fetch": fetched,
        "coordinator_idle_rss_mb": round(idle / MIB, 1),
        "coordinator_peak_rss_mb": round((rss.peak - idle) / MIB, 1),
        "resume": resume,
        "job_s": round(job_s, 1),
        "coordinator_blob_bytes": {"in": carried["in"], "out": carried["out"]},
    }


def resumed_download(net: LocalNetwork, key_hex: str, digest: str) -> dict:
    """One blob fetched through a proxy that cuts the first answer off at half the blob: the share of
    it the resumed request did not send again."""
    port = int(net.url.rsplit(":", 1)[1])
    proxy = CountingProxy(port, cut_after=PART_BYTES // 2)
    try:
        got = fetch_all(proxy.url, key_hex, [digest])
    finally:
        proxy.close()
    first, *rest = proxy.down_by_connection
    return {
        "blob_bytes": got,
        "first_answer_bytes": first,
        "resumed_answer_bytes": sum(rest),
        "resume_saved_bytes": round(1 - sum(rest) / got, 3),
    }


def s3(root: Path, rounds: int) -> dict:
    import s3fs

    port = free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(endpoint), 60, "the S3 server")
        options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
        bucket = f"gpuflex-{secrets.token_hex(4)}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        settings = {
            "GPUFLEX_BLOB_URL": f"s3://{bucket}/blobs",
            "GPUFLEX_BLOB_STORAGE_OPTIONS": json.dumps(options),
        }
        with LocalNetwork(root, settings=settings) as net:
            direct_url = net.start_coordinator()
            proxy = CountingProxy(int(direct_url.rsplit(":", 1)[1]))
            url = proxy.url
            client = Client(url, Client(url).create_account("bench").token, retry_for_s=60)
            client.deposit(50)
            digests, upload_s = upload_model(client)
            keys = register_nodes(url, NODES)
            fetched = fetch_rate(url, keys, digests)
            leave(url, keys)
            job_s = run_job(net, client, url, root, rounds)
            moved = blob_bytes(direct_url)
            proxy.close()
    finally:
        moto.terminate()
        moto.wait()
    signed = moved["signed_in"] + moved["signed_out"]
    return {
        "upload_mb_per_s": round(PARTS * PART_BYTES / upload_s / 1e6, 1),
        "fetch": fetched,
        "job_s": round(job_s, 1),
        "blob_bytes_signed": {"in": moved["signed_in"], "out": moved["signed_out"]},
        "coordinator_blob_bytes": {"in": moved["in"], "out": moved["out"]},
        "coordinator_bytes": {"from_clients": proxy.up, "to_clients": proxy.down},
        "coordinator_bytes_per_blob_byte": round(proxy.total / signed, 6),
    }


def _answers(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint, timeout=1).status_code < 500
    except httpx.TransportError:
        return False


def simulated() -> dict:
    """The simulator's coordinator egress at 10k nodes for the llm-8b job mix, relayed and direct."""
    sys.path.insert(0, str(Path(__file__).parent))
    import sim_scale

    point = sim_scale.run(10_000, 24, "llm-8b")
    return point["data_plane"]["coordinator_egress_gbit_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 2-round job instead of 3")
    args = parser.parse_args()
    rounds = 2 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="gpuflex-data-plane-") as root:
        fs_run = filesystem(Path(root) / "fs", rounds)
        print(f"filesystem store: {json.dumps(fs_run)}", file=sys.stderr, flush=True)
        s3_run = s3(Path(root) / "s3", rounds)
        print(f"S3: {json.dumps(s3_run)}", file=sys.stderr, flush=True)
    sim = simulated()
    result = {
        "coordinator_bytes_per_blob_byte": s3_run["coordinator_bytes_per_blob_byte"],
        "coordinator_peak_rss_mb": fs_run["coordinator_peak_rss_mb"],
        "fetch_throughput_ratio": round(s3_run["fetch"]["mb_per_s"] / fs_run["fetch"]["mb_per_s"], 3),
        "fetch_mb_per_s": {"direct": s3_run["fetch"]["mb_per_s"], "proxied": fs_run["fetch"]["mb_per_s"]},
        "resume_saved_bytes": fs_run["resume"]["resume_saved_bytes"],
        "sim_coordinator_egress_gbit_s_10k_llm_8b": sim,
    }
    result["targets"] = {
        "coordinator_bytes_per_blob_byte<=0.001": result["coordinator_bytes_per_blob_byte"] <= 0.001,
        "coordinator_peak_rss_mb<=200": result["coordinator_peak_rss_mb"] <= 200,
        "resume_saved_bytes>=0.45": result["resume_saved_bytes"] >= 0.45,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "data_plane-quick.json" if args.quick else "data_plane.json"
    (RESULTS / name).write_text(json.dumps({"summary": result, "filesystem": fs_run, "s3": s3_run}, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
