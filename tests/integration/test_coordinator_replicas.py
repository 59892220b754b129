"""Two coordinator processes on one PostgreSQL database, a deployment's two replicas polling the second
(given both addresses, the second first), and the official `openai` client asking the first, which holds
no replica: the request is routed through PostgreSQL's LISTEN/NOTIFY (`coordinator/broker.py`) to the
process holding the replicas' lines and its tokens come back the same way, streamed or not, a long prompt
too (a message past NOTIFY's 8,000 bytes travels in parts); the answers equal the ones the second process
gives directly. Then, in turn:

- PostgreSQL drops both processes' listening connections (`pg_terminate_backend`): each broker logs it,
  connects again and LISTENs again, and requests are routed again;
- a replica is killed (`kill -9`) mid-stream: the streams it held through the first process go on on
  the other replica from the tokens already sent, same seed, one stream each, billed once;
- the second process is killed: the replica left reconnects to the first, which serves it directly.
"""

from __future__ import annotations

import openai
import psycopg
import pytest
from sqlalchemy import make_url

from gpuflex.client import Client
from gpuflex.coordinator.broker import LISTENER
from gpuflex.localnet import LocalNetwork
from gpuflex.testing import save_llama, wait_for

from .test_deployments import _served
from .test_failover import MAX_TOKENS, PROMPT, SEED, _serving, deploy_two_replicas
from .test_finetune import client_token
from .test_network import FAST_LIVENESS

pytestmark = pytest.mark.integration


def _listeners(database_url: str, terminate: bool = False) -> set[int]:
    """The backends of the brokers' listening connections (terminated first, with ``terminate``)."""
    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, CASE WHEN %s THEN pg_terminate_backend(pid) END FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            (terminate, LISTENER),
        ).fetchall()
    return {pid for pid, _ in rows}


def test_requests_are_brokered_between_coordinator_processes_and_fail_over_across_them(
    tmp_path, postgres_database
):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50], context=1024)
    with LocalNetwork(tmp_path / "net", database_url=postgres_database, settings=FAST_LIVENESS) as net:
        first = net.start_coordinator()
        second = net.start_replica()
        for agent in ("c0", "c1"):  # their replicas poll the second process, the first once it is gone
            net.start_agent(agent, price=0.2, url=f"{second},{first}")
        client = Client(first, Client(first).create_account("it").token)
        client.deposit(5)
        wait_for(lambda: len(client.offers()) == 2, 60, "both agents to register")
        who = ["--url", first, "--token", client_token(client)]
        deployment = deploy_two_replicas(model_dir, who)
        made = client.create_key(deployment)
        key = made.key
        direct, brokered = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
            for url in (second, first)
        )
        wait_for(lambda: _served(direct, deployment), 120, "a replica to serve")
        wait_for(lambda: _serving(net, "c0") and _serving(net, "c1"), 120, "both replicas to serve")
        wait_for(lambda: _served(brokered, deployment), 30, "the first process to hear of them")

        long = "alpha beta gamma delta " * 150  # its prompt and completion pass 8,000 bytes
        for prompt in ("alpha", long):
            asked = {"model": deployment, "prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": 3}
            expected = direct.completions.create(**asked)
            answer = brokered.completions.create(**asked)
            assert answer.choices[0].text == expected.choices[0].text
            assert answer.usage.completion_tokens == expected.usage.completion_tokens
            streamed = brokered.completions.create(**asked, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.choices[0].text
        with pytest.raises(openai.BadRequestError, match="context"):  # the replica's refusal, brokered
            brokered.completions.create(model=deployment, prompt=long * 3, max_tokens=4)

        # PostgreSQL drops the listening connections: each broker connects and LISTENs again
        dropped = _listeners(postgres_database, terminate=True)
        assert len(dropped) == 2
        wait_for(lambda: len(_listeners(postgres_database) - dropped) == 2, 30, "both to listen again")
        wait_for(lambda: _served(brokered, deployment), 30, "requests to be routed again")
        for name in ("coordinator", "coordinator-2"):
            assert "relay broker: listening failed" in net.log_tail(name, 20_000)

        def ask(**extra):
            return brokered.completions.create(
                model=deployment, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, seed=SEED, **extra
            )

        reference = ask()  # uninterrupted
        n, text = reference.usage.completion_tokens, reference.choices[0].text
        assert n > 100  # long enough that the kill lands mid-stream
        counted = _on_key(client.deployment(deployment), made.id).completion_tokens
        streams = [ask(stream=True, stream_options={"include_usage": True}) for _ in range(2)]
        read = [[next(iter(s)).choices[0].text for _ in range(20)] for s in streams]  # one on each replica
        net.kill_agent("c0")  # kill -9, its replica too
        for stream, start in zip(streams, read, strict=True):
            chunks = list(stream)
            assert "".join(start) + "".join(c.choices[0].text for c in chunks if c.choices) == text
            assert len(chunks) > 20 and chunks[-1].usage.completion_tokens == n  # mid-stream; billed once
        assert _on_key(client.deployment(deployment), made.id).completion_tokens - counted == 2 * n

        # the second process dies: the replica left polls the first, which serves it itself
        net.stop_replica(second)
        wait_for(lambda: _served(brokered, deployment), 60, "the replica to reconnect to the first")
        assert ask().choices[0].text == text


def _on_key(deployment, key_id: str):
    """The usage counted on one key (the deployment's first row is its owner's account token)."""
    return next(k for k in deployment.keys if k.id == key_id)
