"""Failover through the coordinator's OpenAI gateway: a deployment's two replicas on two agents, each
serving a streamed and a non-streamed request, when one agent and its replica are killed (`kill -9`)
mid-request. The official `openai` client sees nothing of it: the stream held by the killed replica goes
on from the tokens already sent on the replica left, with exactly the text an uninterrupted run gives for
that seed, and is billed once (its usage counts each output token once); the non-streamed one
completes, with the same answer."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from gpuflex.client import Client
from gpuflex.localnet import LocalNetwork
from gpuflex.testing import save_llama, wait_for

from .test_deployments import _cli, _served
from .test_finetune import client_token
from .test_network import FAST_LIVENESS

pytestmark = pytest.mark.integration

PROMPT = "alpha"
MAX_TOKENS = 900
SEED = 5  # the test model draws its end of sequence after 197 tokens with this seed (at temperature 0.9)


def deploy_two_replicas(model_dir: Path, who: list[str]) -> str:
    """``gpuflex deploy --model DIR --replicas 2`` as its owner (``who``): the deployment's id. In fp32, where
    a resumed or batched request rounds as a lone one does, so its text is exactly the uninterrupted run's
    (bf16 may flip a near tie)."""
    limits = ["--replicas", "2", "--max-price", "0.5", "--budget", "1", "--dtype", "fp32"]
    out = _cli("deploy", "--model", str(model_dir), *limits, *who)
    return re.search(r"deployed (d-[0-9a-f]+)", out)[1]


def _serving(net: LocalNetwork, agent: str) -> bool:
    """Whether the agent's replica has loaded the model and polls the relay (its task's log says so)."""
    logs = (net.root / "agents" / agent).rglob("*.log")
    return any("serving (" in p.read_text(errors="replace") for p in logs if p.is_file())


def test_a_replica_killed_mid_request_costs_the_client_nothing(tmp_path: Path):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50], context=1024)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        url = net.start_coordinator()
        net.start_agent("c0", price=0.2)
        net.start_agent("c1", price=0.2)
        client = Client(url, Client(url).create_account("it").token)
        client.deposit(5)
        wait_for(lambda: len(client.offers()) == 2, 60, "both agents to register")
        who = ["--url", url, "--token", client_token(client)]
        deployment = deploy_two_replicas(model_dir, who)
        created = client.create_key(deployment)
        key = created.key
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        wait_for(lambda: _served(gateway, deployment), 120, "a replica to serve")
        wait_for(lambda: _serving(net, "c0") and _serving(net, "c1"), 120, "both replicas to serve")
        time.sleep(1)  # each polls the relay

        def ask(seed: int, **extra):
            return gateway.completions.create(
                model=deployment, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, seed=seed, **extra
            )

        reference = ask(SEED)  # uninterrupted
        n = reference.usage.completion_tokens
        assert n > 100  # long enough (seconds on 2 cores) that the kill lands mid-request
        expected = reference.choices[0].text

        def on_key() -> int:
            return next(k.completion_tokens for k in client.deployment(deployment).keys if k.id == created.id)

        counted = on_key()

        with ThreadPoolExecutor(2) as pool:
            streams = [ask(SEED, stream=True, stream_options={"include_usage": True}) for _ in range(2)]
            read = [
                [next(iter(s)).choices[0].text for _ in range(20)] for s in streams
            ]  # each on its replica
            whole = [pool.submit(ask, SEED)]
            time.sleep(0.3)
            whole.append(pool.submit(ask, SEED))  # the replicas hold one streamed and one whole each
            time.sleep(0.3)
            net.kill_agent("c0")  # kill -9, its replica too, as when the machine dies
            for stream, start in zip(streams, read, strict=True):
                chunks = list(stream)
                text = "".join(start) + "".join(c.choices[0].text for c in chunks if c.choices)
                assert text == expected and len(chunks) > 20  # the kill landed mid-stream
                assert chunks[-1].usage.completion_tokens == n  # billed once
            for answer in whole:
                done = answer.result(timeout=120)
                assert done.choices[0].text == expected and done.usage.completion_tokens == n
        # the four counted once each on the key: none of the killed replica's tokens twice, none lost
        assert on_key() - counted == 4 * n
