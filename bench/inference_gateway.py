"""bench/inference.py's gateway part: the same saved model deployed on a local network (a coordinator and
agents as processes on loopback, ``gpuflex.localnet``) and served through the coordinator's OpenAI
gateway to the official ``openai`` client.

1. Two agents, one replica (``max_batch`` 8, one torch thread: as the direct engine): the direct part's
   requests (as token ids, same sampling settings and seeds) by 1 and by 8 closed-loop streams, streamed
   with ``include_usage``. tokens/s = completion tokens (the usage chunks) / wall seconds; TTFT = the
   request sent to its first chunk read by the client.
2. Failover: the deployment scaled to two replicas (the second on the other agent); 8 closed-loop
   streams of long requests (``FAILOVER_REQUESTS``, 128 tokens each), and once all 8 have read a chunk
   the first replica's agent is killed with it (``kill -9``). A request fails if it raises or its text
   differs from the direct engine's for the same prompt and seed. For each request in flight at the
   kill, the gap between its last chunk before and its first after, less its own median gap between
   chunks, is what the kill added; the requests the killed replica held are those it added more than
   ``HELD_MS`` to (the others only share the cores).

Each run of part 1 also reports the CPU seconds each process spent on it (``cpu_s``: this process's
clients, the coordinator, the agents, their tasks: the replica with its engine) and their sum per output
token (``cpu_ms_per_token``). On a machine shared with other work the wall-clock ratios follow its load;
the CPU a token costs on each side of the gateway does not, and says what the gateway adds.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import openai

from gpuflex.cli.deploy import upload_served_model
from gpuflex.client import Client
from gpuflex.localnet import LocalNetwork, descendants
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.serve.sampling import SamplingParams
from gpuflex.testing import wait_for

LIVENESS = {"GPUFLEX_HEARTBEAT_INTERVAL_S": "1", "GPUFLEX_LEASE_TTL_S": "8"}
FAILOVER_REQUESTS = 16
FAILOVER_TOKENS = 128
HELD_MS = 100.0
AGENTS = ("a0", "a1")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _serving(net: LocalNetwork, agent: str) -> bool:
    """Whether the agent's replica loaded the model and polls the relay (its task's log says so)."""
    logs = (net.root / "agents" / agent).rglob("*.log")
    return any("serving (" in p.read_text(errors="replace") for p in logs if p.is_file())


class _Streams:
    """Requests through the gateway by ``count`` closed-loop streams, each chunk's arrival kept."""

    def __init__(
        self, gateway: openai.OpenAI, model: str, prompts: list[list[int]], params: list[SamplingParams]
    ):
        self.gateway, self.model = gateway, model
        self.work = list(enumerate(zip(prompts, params, strict=True)))
        self.lock = threading.Lock()
        self.sent: dict[int, float] = {}
        self.chunks: dict[int, list[float]] = {}
        self.texts: dict[int, str] = {}
        self.tokens = 0
        self.failed: list[str] = []

    def run(self, count: int, during=None) -> float:
        """Serve them all; ``during()`` runs in this thread meanwhile. Wall seconds."""
        started = time.perf_counter()
        workers = [threading.Thread(target=self._stream) for _ in range(count)]
        for w in workers:
            w.start()
        if during is not None:
            during()
        for w in workers:
            w.join()
        return time.perf_counter() - started

    def _stream(self) -> None:
        while True:
            with self.lock:
                if not self.work:
                    return
                i, (prompt, p) = self.work.pop(0)
            self.sent[i] = time.perf_counter()
            arrivals: list[float] = []
            self.chunks[i] = arrivals
            text = []
            try:
                stream = self.gateway.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=p.max_tokens,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    stop=list(p.stop) or None,
                    seed=p.seed,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.choices:
                        arrivals.append(time.perf_counter())
                        text.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        with self.lock:
                            self.tokens += chunk.usage.completion_tokens
                self.texts[i] = "".join(text)
            except openai.OpenAIError as err:
                self.failed.append(f"request {i}: {err}")

    def ttft_ms(self) -> list[float]:
        return [(c[0] - self.sent[i]) * 1000 for i, c in self.chunks.items() if c]


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a live process (Linux: /proc); 0 for one that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s(net: LocalNetwork) -> dict[str, float]:
    """CPU seconds so far: this process (the clients), the coordinator, the agents, their tasks."""
    agents = [process.pid for process in net.agents.values()]
    assert net.coordinator is not None, "the network runs"
    return {
        "clients": sum(os.times()[:2]),
        "coordinator": _process_cpu_s(net.coordinator.pid),
        "agents": sum(_process_cpu_s(pid) for pid in agents),
        "tasks": sum(_process_cpu_s(pid) for agent in agents for pid in descendants(agent)),
    }


def _figures(streams: _Streams, wall: float, count: int, cpu: dict[str, float]) -> dict:
    ms = streams.ttft_ms()
    return {
        "streams": count,
        "requests": len(streams.texts),
        "failed": len(streams.failed),
        "tokens": streams.tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(streams.tokens / wall, 1),
        "ttft_p50_ms": round(_percentile(ms, 50), 1),
        "ttft_p99_ms": round(_percentile(ms, 99), 1),
        "ttft_max_ms": round(max(ms), 1),
        "cpu_s": {name: round(seconds, 2) for name, seconds in cpu.items()},
        "cpu_ms_per_token": round(sum(cpu.values()) / streams.tokens * 1000, 3),
    }


def measure(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams], expected: dict) -> dict:
    """The gateway's figures; ``expected``: the failover requests' texts as the direct engine gives them
    (``failover_work``)."""
    with (
        tempfile.TemporaryDirectory(prefix="gpuflex-gateway-") as tmp,
        LocalNetwork(Path(tmp) / "net", settings=LIVENESS) as net,
    ):
        url = net.start_coordinator()
        for agent in AGENTS:  # both at once: the second waits for the failover part
            net.start_agent(agent, price=0.2)
        owner = Client(url, Client(url).create_account("bench").token)
        owner.deposit(50)
        wait_for(lambda: len(owner.offers()) == 2, 60, "the agents to register")
        spec = DeploymentSpec.model_validate(
            {
                "name": "bench",
                "model": upload_served_model(owner, model_dir).model_dump(exclude_none=True),
                "replicas": 1,
                "max_price_per_hour": 1.0,
                "budget": 10.0,
                "context": 512,
                "dtype": "fp32",  # as the direct engine: the failover texts are compared to its
            }
        )
        deployment = owner.deploy(spec).id
        key = owner.create_key(deployment).key
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        wait_for(lambda: any(_serving(net, a) for a in AGENTS), 180, "the replica to serve")
        first = next(a for a in AGENTS if _serving(net, a))
        time.sleep(1)
        through = {}
        for count in (1, 8):
            streams = _Streams(gateway, deployment, prompts, params)
            before = _cpu_s(net)
            wall = streams.run(count)
            cpu = {name: seconds - before[name] for name, seconds in _cpu_s(net).items()}
            through[f"{count}_streams"] = _figures(streams, wall, count, cpu)
            print(f"  gateway: {through[f'{count}_streams']}", flush=True)

        owner.scale(deployment, 2)
        wait_for(lambda: all(_serving(net, a) for a in AGENTS), 180, "the second replica to serve")
        time.sleep(1)
        failover = _failover(net, first, gateway, deployment, expected)
        print(f"  failover: {failover}", flush=True)
        owner.stop_deployment(deployment)
    return {**through, "failover": failover}


def failover_work(prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list]:
    """The failover's requests: the first prompts, each to ``FAILOVER_TOKENS`` tokens (no stop string)."""
    chosen = [replace(p, max_tokens=FAILOVER_TOKENS, stop=()) for p in params[:FAILOVER_REQUESTS]]
    return prompts[:FAILOVER_REQUESTS], chosen


def _failover(net: LocalNetwork, killed: str, gateway: openai.OpenAI, model: str, expected: dict) -> dict:
    prompts, params = expected["prompts"], expected["params"]
    streams = _Streams(gateway, model, prompts, params)
    killed_at = [0.0]

    def kill() -> None:
        wait_for(lambda: sum(1 for c in list(streams.chunks.values()) if c) >= 8, 60, "8 streams under way")
        killed_at[0] = time.perf_counter()
        net.kill_agent(killed)  # kill -9, with its replica

    wall = streams.run(8, kill)
    mismatched = [i for i, text in streams.texts.items() if text != expected["texts"][i]]
    added = []
    for arrivals in streams.chunks.values():
        before = [t for t in arrivals if t <= killed_at[0]]
        after = [t for t in arrivals if t > killed_at[0]]
        if before and after:
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            added.append((after[0] - before[-1] - statistics.median(gaps)) * 1000)
    held = sorted((a for a in added if a > HELD_MS), reverse=True)
    return {
        "requests": len(prompts),
        "failed": len(streams.failed) + len(mismatched),
        "errors": streams.failed[:3],
        "mismatched": len(mismatched),
        "wall_s": round(wall, 2),
        "in_flight_at_kill": len(added),
        "held": len(held),
        "held_added_latency_ms": [round(a, 1) for a in held],
        "others_added_latency_max_ms": round(max([a for a in added if a <= HELD_MS], default=0.0), 1),
    }
