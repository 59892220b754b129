"""Two coordinator processes on one PostgreSQL database: a deployment's replica polls the second, and the
official `openai` client asks the first, which holds no replica of it; the request is routed through
PostgreSQL's LISTEN/NOTIFY (`coordinator/broker.py`) to the process holding the replica's line and its
tokens come back the same way, streamed or not, a long prompt too (a message past NOTIFY's 8,000 bytes
travels in parts); the answers equal the ones the second process gives directly."""

from __future__ import annotations

import re

import openai
import pytest

from gpuflex.client import Client
from gpuflex.localnet import LocalNetwork
from gpuflex.testing import save_llama, wait_for

from .test_deployments import _cli, _served
from .test_finetune import client_token
from .test_network import FAST_LIVENESS

pytestmark = pytest.mark.integration


def test_a_request_to_the_coordinator_without_the_replica_is_brokered_through_postgresql(
    tmp_path, postgres_database
):
    model_dir = save_llama(tmp_path / "m", ["alpha beta gamma delta. " * 50], context=1024)
    with LocalNetwork(tmp_path / "net", database_url=postgres_database, settings=FAST_LIVENESS) as net:
        first = net.start_coordinator()
        second = net.start_replica()
        net.start_agent("c0", price=0.2, url=second)  # its replica polls the second process only
        client = Client(first, Client(first).create_account("it").token)
        client.deposit(5)
        who = ["--url", first, "--token", client_token(client)]
        out = _cli("deploy", "--model", str(model_dir), "--max-price", "0.5", "--budget", "1", *who)
        deployment = re.search(r"deployed (d-[0-9a-f]+)", out)[1]
        key = client.create_key(deployment).key
        direct, brokered = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
            for url in (second, first)
        )
        wait_for(lambda: _served(direct, deployment), 120, "the replica to serve")
        wait_for(lambda: _served(brokered, deployment), 30, "the first process to hear of it")

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
