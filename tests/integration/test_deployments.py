"""A model deployed on a real network and used through the coordinator's OpenAI gateway: `gpuflex deploy
--model DIR --wait` uploads a saved llama, a community agent leases its replica, loads it from its cache and
holds the relay open from its side, and `--wait` returns once it does (its log says it loaded, and when it
became ready); the official `openai` client then chats at once (streamed and not) and completes
with a deployment key, whose usage `deployment show` counts; a wrong key, another deployment's key, an
unknown model and a prompt past the context are each an OpenAI error object, and none is counted; the
owner's `gpuflex chat` counts on its account-token row; a key held by another account at a price per
token is paid to the owner when the deployment stops, and one whose holder cannot pay is a 402; the
deployment's Prometheus series count what was served and refused. With `--audit-rate 1` the core node
re-checks every request the community replica served, and passes them all. When the replica's node is
killed (`kill -9`), the replica is placed again on the community node left, which serves an int8 copy of
the model (`--adversary serve-int8`): the core node's audit convicts it, it is slashed and barred, and the
replica is placed again, on the core node, and serves."""

from __future__ import annotations

import contextlib
import itertools
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gpuflex.auth.signing import NodeKey
from gpuflex.cli.main import app
from gpuflex.client import Client, NodeClient
from gpuflex.ledger.export import from_export
from gpuflex.ledger.journal import balances, verify_chain
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.testing import save_llama, wait_for

from .test_finetune import client_token
from .test_network import FAST_LIVENESS

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "alpha beta"}]


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _served(gateway: openai.OpenAI, model: str) -> bool:
    """Whether a replica answers yet (503 while it is placed or loads the model; a request handed to a
    replica that just died waits for it, so the probe gives up sooner)."""
    try:
        gateway.with_options(timeout=5).completions.create(model=model, prompt="alpha", max_tokens=1)
    except (openai.InternalServerError, openai.APITimeoutError):
        return False
    return True


def test_a_deployed_model_answers_openai_clients_through_the_gateway(tmp_path):
    # init_std 0.1: layers that matter to the hidden states, as a trained model's (tests/serve/conftest.py)
    model_dir = save_llama(tmp_path / "my-model", ["alpha beta gamma delta. " * 50], hidden=64, init_std=0.1)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        url = net.start_coordinator()
        net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])  # audits
        net.start_agent("c0", price=0.2)
        client = Client(url, Client(url).create_account("it").token)
        client.deposit(5)
        # both online before it is placed: on c0 (cheaper), as a core node's requests are not audited
        wait_for(lambda: sum(o.state == "online" for o in client.offers()) == 2, 60, "the agents to register")
        who = ["--url", url, "--token", client_token(client)]
        args = ["--max-price", "0.5", "--budget", "1", "--audit-rate", "1", "--wait"]
        out = _cli("deploy", "--model", str(model_dir), *args, *who)
        deployment = re.search(r"deployed (d-[0-9a-f]+)", out)[1]
        assert f"deployment {deployment} answers: 1 of 1 replicas live" in out  # no request before it
        logged = _cli("deployment", "logs", deployment, *who)
        assert "loading the model" in logged and "ready: answers requests" in logged, logged
        key = re.search(r"gfxkey_[\w-]+", _cli("deployment", "key", "create", deployment, *who))[0]
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)

        said = gateway.chat.completions.create(model=deployment, messages=CHAT, max_tokens=6, temperature=0)
        assert said.choices[0].finish_reason in ("stop", "length") and said.usage.completion_tokens >= 1
        streamed = gateway.chat.completions.create(
            model="my-model", messages=CHAT, max_tokens=6, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == said.choices[0].message.content
        completed = gateway.completions.create(model=deployment, prompt="gamma", max_tokens=4, seed=7)
        assert completed.usage.prompt_tokens >= 1 and completed.model == deployment
        assert [m.id for m in gateway.models.list()] == [deployment]

        # priced under the core node: it waits for a community node
        spec = client.deployment(deployment).spec.model_copy(
            update={"name": "other", "max_price_per_hour": 0.3}
        )
        other = client.deploy(spec)
        others_key = client.create_key(other.id).key
        refusals = (
            (openai.AuthenticationError, key[:-3] + "xyz", deployment, "unknown API key"),
            (
                openai.PermissionDeniedError,
                others_key,
                deployment,
                f"this API key is for {other.id}",
            ),
            (openai.NotFoundError, key, "no-such-model", "no deployment no-such-model"),
            (openai.BadRequestError, key, deployment, "context"),
        )
        for error, api_key, model, says in refusals:
            caller = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=30)
            long = "alpha beta gamma delta " * (200 if error is openai.BadRequestError else 1)
            with pytest.raises(error, match=says) as refused:
                caller.completions.create(model=model, prompt=long, max_tokens=4)
            assert refused.value.body["message"] and refused.value.status_code < 500
        client.stop_deployment(other.id)  # it waited for a node, and would take the next one

        # the owner's account token: served, counted on the deployment's account-token row, not the key
        chatted = CliRunner().invoke(app, ["chat", "my-model", *who], input="alpha beta\n\n")
        assert chatted.exit_code == 0 and chatted.output.count("you>") == 2, chatted.output

        # a key held by another account at a price per token: its holder pays the owner when it stops
        payer = Client(url, Client(url).create_account("payer").token)
        payer.deposit(1)
        priced = ("--for", "payer", "--price-in", "100", "--price-out", "200")
        made = _cli("deployment", "key", "create", deployment, *priced, *who)
        assert "gfxkey_" not in made  # only the payer sees the secret of a key it pays for
        key_id = re.search(r"key\s+claim\s+(k-[0-9a-f]+)", made)[1]
        claimed = _cli("deployment", "key", "claim", key_id, "--url", url, "--token", client_token(payer))
        paying = re.search(r"gfxkey_[\w-]+", claimed)[0]
        bought = openai.OpenAI(base_url=f"{url}/v1", api_key=paying, max_retries=0, timeout=30)
        used = bought.chat.completions.create(model=deployment, messages=CHAT, max_tokens=6).usage
        cost = (used.prompt_tokens * 100 + used.completion_tokens * 200) / 1e6
        broke = Client(url, Client(url).create_account("broke").token)
        broke_key = broke.claim_key(client.create_key(deployment, holder="broke", price_out=1).id).key
        unpaid = openai.OpenAI(base_url=f"{url}/v1", api_key=broke_key, max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError, match="deposit credits") as refused:
            unpaid.chat.completions.create(model=deployment, messages=CHAT, max_tokens=6)
        assert refused.value.status_code == 402 and refused.value.body["type"] == "insufficient_quota"

        shown = client.deployment(deployment)
        served = [(k.holder, k.account_token, k.requests, k.completion_tokens > 0) for k in shown.keys]
        assert served == [  # the key: 3; the account token: one chat turn
            ("it", True, 1, True),
            ("it", False, 3, True),
            ("payer", False, 1, True),
            ("broke", False, 0, False),
        ]
        assert shown.keys[2].accrued == pytest.approx(cost) and shown.keys[2].settled == 0
        metrics = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in family.samples
        }
        label = (("deployment", shown.id),)
        # every request served, on a key or the account token, once
        served_total = sum(k.requests for k in shown.keys)
        assert metrics[("gpuflex_deployment_requests_total", label)] == served_total
        assert metrics[("gpuflex_deployment_request_duration_seconds_count", label)] == served_total
        tokens = [
            metrics[("gpuflex_deployment_tokens_total", (*label, ("kind", k)))] for k in ("input", "output")
        ]
        assert tokens == [
            sum(k.prompt_tokens for k in shown.keys),
            sum(k.completion_tokens for k in shown.keys),
        ]
        refusals = ("deployment", shown.id), ("status", "402"), ("type", "insufficient_quota")
        assert metrics[("gpuflex_deployment_errors_total", refusals)] == 1
        assert (shown.state, shown.live_replicas) == ("running", 1)
        assert shown.requests_per_s >= 5 / 60 and shown.tokens_per_s > 0 and 0 < shown.ttft_p50_ms < 10_000
        listed = _cli("deployments", *who)
        assert deployment in listed and "1/1" in listed and other.id in listed
        assert shown.keys[0].id in _cli("deployment", "show", deployment, *who)
        # every request was audited by the core node, and passed: no false positive, nothing billed twice
        wait_for(lambda: client.deployment(deployment).audits.pending == 0, 120, "the audits to be judged")
        shown = client.deployment(deployment)
        assert (shown.audits.passed, shown.audits.failed, shown.verdicts) == (served_total, 0, [])

        # a lost replica is placed again, on the community node that is left: a cheater
        net.start_agent("c1", price=0.3, extra=["--adversary", "serve-int8"])
        wait_for(lambda: len(client.offers()) == 3, 60, "the third agent to register")
        nodes = {o.name: o.node_id for o in client.offers()}
        cheater = NodeClient(url, NodeKey.load_or_create(tmp_path / "net" / "agents" / "c1" / "node.key"))
        cheater.stake(2.0)
        net.kill_agent("c0")
        wait_for(lambda: client.deployment(deployment).tasks[0].epoch == 2, 60, "the replica to be re-placed")
        assert client.deployment(deployment).tasks[0].node_id == nodes["c1"]
        wait_for(lambda: _served(gateway, deployment), 120, "the new replica to serve")
        seeds = itertools.count()

        def convicted() -> bool:
            """Chat on until the cheater is convicted: once it is (the probe above may already be audited),
            its replica is gone and the chat is a 503 until the core node's replica serves."""
            with contextlib.suppress(openai.InternalServerError):
                seed = next(seeds)
                gateway.chat.completions.create(model=deployment, messages=CHAT, max_tokens=32, seed=seed)
            return bool(client.deployment(deployment).verdicts)

        wait_for(convicted, 120, "the core node to convict the cheater")
        (verdict,) = client.deployment(deployment).verdicts
        assert (verdict.node_id, verdict.check, verdict.guilty, verdict.slashed) == (
            nodes["c1"],
            "inference-audit",
            True,
            1.0,
        )
        assert verdict.evidence["auditor"] == nodes["core"] and cheater.wallet().stake == pytest.approx(1.0)
        # barred: the replica is placed again, on the core node, and serves
        wait_for(lambda: client.deployment(deployment).tasks[0].epoch == 3, 60, "the replica to leave c1")
        assert client.deployment(deployment).tasks[0].node_id == nodes["core"]
        wait_for(lambda: _served(gateway, deployment), 120, "the core node's replica to serve")
        shown = _cli("deployment", "show", deployment, *who)
        assert "inference-audit" in shown and "guilty" in shown and "failed" in shown
        stopped = client.stop_deployment(deployment)  # the payer's tokens are settled with it
        assert client.balance().balance == pytest.approx(5 - stopped.spent + cost, abs=1e-6)
        assert payer.balance().balance == pytest.approx(1 - cost, abs=1e-6)
        assert [k.settled for k in client.deployment(deployment).keys][2] == pytest.approx(cost, abs=1e-6)
        journal = from_export(client.ledger())
        assert verify_chain(journal).ok and sum(balances(journal).values()) == 0
        assert [e.kind for e in journal].count("usage") == 1  # one entry for the payer's key, at the stop
