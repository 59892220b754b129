"""A model deployed on a real network and used through the coordinator's OpenAI gateway: `gpuflex deploy
--model DIR` uploads a saved llama, a community agent leases its replica, loads it from its cache and holds
the relay open from its side; the official `openai` client then chats (streamed and not) and completes
with a deployment key, whose usage `deployment show` counts; a wrong key, another deployment's key, an
unknown model and a prompt past the context are each an OpenAI error object, and none is counted; when
the replica's node is killed (`kill -9`), the replica is placed again on the node left and serves. With
`--audit-rate 1` a core node re-checks every request: a provider serving an int8 copy of the model is
convicted, slashed, barred and its replica placed again, while the honest one passes every audit."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from typer.testing import CliRunner

from gpuflex.auth.signing import NodeKey
from gpuflex.cli.main import app
from gpuflex.client import Client, NodeClient
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
    model_dir = save_llama(tmp_path / "my-model", ["alpha beta gamma delta. " * 50])
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        url = net.start_coordinator()
        net.start_agent("c0", price=0.2)
        client = Client(url, Client(url).create_account("it").token)
        client.deposit(5)
        who = ["--url", url, "--token", client_token(client)]
        out = _cli("deploy", "--model", str(model_dir), "--max-price", "0.5", "--budget", "1", *who)
        deployment = re.search(r"deployed (d-[0-9a-f]+)", out)[1]
        key = re.search(r"gfxkey_[\w-]+", _cli("deployment", "key", "create", deployment, *who))[0]
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        wait_for(lambda: _served(gateway, deployment), 120, "the replica to serve")

        said = gateway.chat.completions.create(model=deployment, messages=CHAT, max_tokens=6, temperature=0)
        assert said.choices[0].finish_reason in ("stop", "length") and said.usage.completion_tokens >= 1
        streamed = gateway.chat.completions.create(
            model="my-model", messages=CHAT, max_tokens=6, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == said.choices[0].message.content
        completed = gateway.completions.create(model=deployment, prompt="gamma", max_tokens=4, seed=7)
        assert completed.usage.prompt_tokens >= 1 and completed.model == deployment
        assert [m.id for m in gateway.models.list()] == [deployment]

        other = client.deploy(client.deployment(deployment).spec.model_copy(update={"name": "other"}))
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

        # the owner's account token: served, not counted on the key
        chatted = CliRunner().invoke(app, ["chat", "my-model", *who], input="alpha beta\n\n")
        assert chatted.exit_code == 0 and chatted.output.count("you>") == 2, chatted.output
        shown = client.deployment(deployment)
        assert [(k.requests, k.completion_tokens > 0) for k in shown.keys] == [(4, True)]  # 3 + the probe
        assert (shown.state, shown.live_replicas) == ("running", 1)
        assert shown.requests_per_s >= 5 / 60 and shown.tokens_per_s > 0 and 0 < shown.ttft_p50_ms < 10_000
        listed = _cli("deployments", *who)
        assert deployment in listed and "1/1" in listed and other.id in listed
        assert shown.keys[0].id in _cli("deployment", "show", deployment, *who)

        net.start_agent("c1", price=0.3)  # a lost replica is placed again, on the node that is left
        wait_for(lambda: len(client.offers()) == 2, 60, "the second agent to register")
        net.kill_agent("c0")
        wait_for(lambda: client.deployment(deployment).tasks[0].epoch == 2, 60, "the replica to be re-placed")
        wait_for(lambda: _served(gateway, deployment), 120, "the new replica to serve")
        (task,) = client.deployment(deployment).tasks
        assert {o.node_id: o.name for o in client.offers()}[task.node_id] == "c1"
        stopped = client.stop_deployment(deployment)
        assert client.balance().balance == pytest.approx(5 - stopped.spent)


def test_a_core_node_audits_outputs_and_a_cheating_replica_is_slashed_barred_and_replaced(tmp_path):
    # init_std 0.1: layers that matter to the hidden states, as a trained model's (tests/serve/conftest.py)
    corpus = ["alpha beta gamma delta epsilon zeta eta theta. " * 60]
    model_dir = save_llama(tmp_path / "m", corpus, hidden=64, context=256, init_std=0.1)
    with LocalNetwork(tmp_path / "net", settings=FAST_LIVENESS) as net:
        url = net.start_coordinator()
        net.start_agent("core", price=0.1, core=True, extra=["--core-token", CORE_TOKEN])
        net.start_agent("honest", price=0.2)
        net.start_agent("cheat", price=0.2, extra=["--adversary", "serve-int8"])
        client = Client(url, Client(url).create_account("it").token)
        client.deposit(5)
        wait_for(lambda: len(client.offers()) == 3, 60, "three nodes to register")
        names = {o.name: o.node_id for o in client.offers()}
        cheater = NodeClient(url, NodeKey.load_or_create(tmp_path / "net" / "agents" / "cheat" / "node.key"))
        cheater.stake(2.0)
        who = ["--url", url, "--token", client_token(client)]
        args = ["--replicas", "2", "--audit-rate", "1", "--max-price", "0.5", "--budget", "2"]
        out = _cli("deploy", "--model", str(model_dir), *args, *who)
        deployment = re.search(r"deployed (d-[0-9a-f]+)", out)[1]
        key = re.search(r"gfxkey_[\w-]+", _cli("deployment", "key", "create", deployment, *who))[0]
        gateway = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        wait_for(lambda: client.deployment(deployment).live_replicas == 2, 120, "both replicas to be leased")
        placed = {t.node_id for t in client.deployment(deployment).tasks}
        assert placed == {names["honest"], names["cheat"]}  # community first: the core node only audits

        def ask(i: int) -> int:
            words = " ".join(corpus[0].split()[i : i + 6])
            said = gateway.chat.completions.create(
                model=deployment, messages=[{"role": "user", "content": words}], max_tokens=40, seed=i
            )
            return said.usage.completion_tokens

        wait_for(lambda: _served(gateway, deployment), 120, "the replicas to serve")
        with ThreadPoolExecutor(4) as pool:  # concurrent: the gateway spreads them over both replicas
            assert all(n >= 1 for n in pool.map(ask, range(8)))

        def convicted() -> bool:
            return any(v.guilty for v in client.deployment(deployment).verdicts)

        wait_for(convicted, 120, "the core node to convict the cheater")
        shown = client.deployment(deployment)
        (verdict,) = shown.verdicts
        assert (verdict.node_id, verdict.check, verdict.slashed) == (names["cheat"], "inference-audit", 1.0)
        assert verdict.evidence["auditor"] == names["core"]
        assert cheater.wallet().stake == pytest.approx(1.0)
        # every request was audited once, and billed to the key once (8 and the probes that answered)
        wait_for(lambda: client.deployment(deployment).audits.pending == 0, 120, "every audit to be judged")
        shown = client.deployment(deployment)
        assert shown.audits.failed >= 1 and shown.audits.passed >= 1
        (billed,) = [k.requests for k in shown.keys]
        assert billed >= 9 and shown.audits.passed + shown.audits.failed == billed
        assert not any(v.node_id == names["honest"] for v in shown.verdicts)  # no false positive

        # the cheater's replica is placed again, on the node left (the core node), and serves
        def replaced() -> bool:
            tasks = client.deployment(deployment).tasks
            return sorted(t.node_id for t in tasks if t.state == "leased") == sorted(
                [names["honest"], names["core"]]
            )

        wait_for(replaced, 60, "the cheater's replica to be placed again")
        wait_for(
            lambda: client.deployment(deployment).live_replicas == 2, 120, "the new replica to be leased"
        )
        with ThreadPoolExecutor(4) as pool:
            assert all(n >= 1 for n in pool.map(ask, range(4)))
        shown_cli = _cli("deployment", "show", deployment, *who)
        assert "inference-audit" in shown_cli and "guilty" in shown_cli and names["cheat"] in shown_cli
