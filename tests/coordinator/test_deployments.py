"""Deployments in the control plane: created with escrow, placed, leased and metered as a job's tasks are,
scaled, stopped with a refund, ended by their budget, seen only by their owner; on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update
from typer.testing import CliRunner

from gpuflex.cli.deploy import upload_served_model
from gpuflex.cli.inputs import upload_model
from gpuflex.cli.main import app
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import Account, Job
from gpuflex.coordinator.services import deployment_keys, ledger
from gpuflex.errors import BadRequest, Conflict, InsufficientFunds, NotFound
from gpuflex.ledger import accounts
from gpuflex.market.matching import Requirements
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.storage.bundles import bundle_directory
from gpuflex.testing import check_invariants, save_llama, wait_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("model") / "m", ["alpha beta gamma delta. " * 50])


def spec(model, **fields) -> DeploymentSpec:
    body = {"name": "chat", "model": model.model_dump(exclude_none=True), "budget": 1.0, **fields}
    return DeploymentSpec.model_validate({"max_price_per_hour": 0.5, **body})


def held(grant: m.LeaseGrant) -> list[m.LeaseHeld]:
    return [m.LeaseHeld(lease_id=grant.lease_id, epoch=grant.epoch)]


def lease_all(nodes) -> dict[int, m.LeaseGrant]:
    """Each node asks for work (the first ask places what is pending, on whichever nodes rank best): the
    leases granted, by the node's position."""
    return {i: grant for i, node in enumerate(nodes) if (grant := node.lease()) is not None}


def test_the_spec_names_one_model_source_and_fields_it_does_not_know_are_errors():
    with pytest.raises(ValidationError, match="exactly one"):
        DeploymentSpec.model_validate({"name": "d", "model": {}})
    with pytest.raises(ValidationError, match="exactly one"):
        DeploymentSpec.model_validate({"name": "d", "model": {"job": "j-1", "from": "./m"}})
    with pytest.raises(ValidationError, match="checkpoint and training come with job"):
        DeploymentSpec.model_validate({"name": "d", "model": {"from": "./m", "checkpoint": "0" * 64}})
    with pytest.raises(ValidationError, match="replicas"):
        DeploymentSpec.model_validate({"name": "d", "model": {"job": "j-1"}, "replicas": 0})
    with pytest.raises(ValidationError, match="Extra inputs"):
        DeploymentSpec.model_validate({"name": "d", "model": {"job": "j-1"}, "rounds": 3})


def test_a_replica_on_a_gpu_needs_its_weights_and_a_full_kv_cache(coordinator, model_dir):
    model = upload_served_model(coordinator.consumer("alice"), model_dir)
    small, long = Requirements.from_spec(spec(model)), Requirements.from_spec(spec(model, context=1 << 20))
    assert 0 < small.gpu_vram_gb < long.gpu_vram_gb
    assert small.workers == 1 and small.start_workers == 1 and small.min_core_workers == 0
    assert Requirements.from_spec(spec(model, resources={"min_vram_gb": 3})).gpu_vram_gb == 0


def test_a_deployment_is_escrowed_placed_leased_as_servers_and_only_its_owner_sees_it(coordinator, model_dir):
    alice, bob = coordinator.consumer("alice", deposit=5), coordinator.consumer("bob", deposit=5)
    model = upload_served_model(alice, model_dir)
    created = alice.deploy(spec(model, replicas=2))
    assert (created.state, created.replicas, created.live_replicas) == ("pending", 2, 0)
    assert alice.balance().balance == 4
    nodes = [coordinator.node(f"n{i}", price=0.2) for i in range(2)]
    grants = [n.lease() for n in nodes]
    assert all(g is not None and g.role == "server" for g in grants)
    assert isinstance(grants[0].task, m.ServerConfig) and grants[0].task.model == model
    assert sorted(g.task.replica for g in grants) == [0, 1]
    first, second = sorted(grants, key=lambda g: g.task.replica)
    shown = alice.deployment(created.id[:4])  # leased is not live: a replica answers once it polls
    assert (shown.state, shown.live_replicas) == ("starting", 0)
    assert shown.reason == "replica 0 starting on its node; replica 1 starting on its node"
    coordinator.task(first).relay_phase("loading")
    coordinator.task(second).relay_phase("downloading")
    said = alice.deployment(created.id)
    assert (said.state, said.reason) == (
        "starting",
        "replica 0 loading the model; replica 1 downloading the model",
    )
    coordinator.task(first).relay_poll(0)  # its model loaded, it polls: it answers
    shown = alice.deployment(created.id)
    assert (shown.state, shown.live_replicas, shown.reason) == (
        "running",
        1,
        "replica 1 downloading the model",
    )
    coordinator.task(second).relay_poll(0)
    coordinator.task(second).relay_poll(0)
    assert (alice.deployment(created.id).live_replicas, alice.deployments()[0].reason) == (2, "")
    logged = [e.message for e in alice.deployment_logs(created.id) if e.message.startswith("[server")]
    assert [line.split("] ")[1].split(",")[0] for line in logged] == [
        "loading the model",
        "downloading the model",
        "ready: answers requests",
        "ready: answers requests",  # once a replica, however often it polls
    ]
    assert [d.id for d in alice.deployments()] == [created.id]
    assert alice.jobs() == []  # a deployment is not a training job
    assert bob.deployments() == []
    for call in (bob.deployment, bob.stop_deployment, lambda d: bob.scale(d, 3), alice.job):
        with pytest.raises(NotFound):
            call(created.id)


def test_scaling_places_new_replicas_and_cancels_the_newest_and_stop_refunds_the_rest(coordinator, model_dir):
    began = time.monotonic()  # the clock is real time plus what the test advances: leases meter both
    alice = coordinator.consumer("alice", deposit=5)
    d = alice.deploy(spec(upload_served_model(alice, model_dir), replicas=1))
    nodes = [coordinator.node(f"n{i}", price=0.36) for i in range(3)]
    leased = lease_all(nodes)
    assert len(leased) == 1
    assert alice.scale(d.id, 3).replicas == 3
    leased |= lease_all(nodes)
    assert sorted(g.task.replica for g in leased.values()) == [0, 1, 2]
    coordinator.clock.advance(10)
    for i, grant in leased.items():
        assert nodes[i].heartbeat(held(grant)).revoked == []
    scaled = alice.scale(d.id, 1)
    assert (scaled.replicas, scaled.live_replicas) == (1, 0)  # none polled the relay: none answers
    revoked = {g.task.replica: nodes[i].heartbeat(held(g)).revoked for i, g in leased.items()}
    cancelled = {g.task.replica: [g.lease_id] for g in leased.values() if g.task.replica > 0}
    assert revoked == {0: [], **cancelled}
    assert alice.scale(d.id, 2).replicas == 2  # a new replica, not a cancelled one back
    assert [t.state for t in alice.deployment(d.id).tasks] == ["leased", "cancelled", "cancelled", "pending"]
    said = [e.message for e in alice.deployment_logs(d.id)]
    assert "scaled from 3 to 1 replicas by alice" in said and "server 2 cancelled" in said
    coordinator.clock.advance(10)
    stopped = alice.stop_deployment(d.id)
    # replica 0 leased 20 s, the two cancelled ones 10 s each, plus the real seconds the test took on
    # each of the three leases (and a second each of rounding); a cancelled replica still metered
    # through the second advance would add 20 s
    real_s = time.monotonic() - began
    assert stopped.state == "cancelled"
    assert 0.36 * 40 / 3600 <= stopped.spent <= 0.36 * (40 + 3 * (real_s + 1)) / 3600
    assert alice.balance().balance == pytest.approx(5 - stopped.spent)
    with pytest.raises(Conflict, match="ended"):
        alice.scale(d.id, 3)
    with pytest.raises(Conflict, match="ended"):
        alice.stop_deployment(d.id)
    assert check_invariants(coordinator.ctx.settings.database_url) == []


def test_a_lost_replica_is_placed_again_and_an_empty_budget_ends_the_deployment(coordinator, model_dir):
    alice = coordinator.consumer("alice", deposit=5)
    d = alice.deploy(spec(upload_served_model(alice, model_dir), budget=0.004, max_price_per_hour=1))
    nodes = [coordinator.node("a", price=0.9), coordinator.node("b", price=0.9)]
    ((i, grant),) = lease_all(nodes).items()
    holder, other = nodes[i], nodes[1 - i]
    coordinator.clock.advance(20)  # past the lease's 15 s, unrenewed
    other.heartbeat([])
    reap_once(coordinator.ctx)
    again = other.lease()
    assert again is not None and again.task_id == grant.task_id and again.epoch == grant.epoch + 1
    assert holder.heartbeat(held(grant)).revoked == [grant.lease_id]
    coordinator.clock.advance(20)  # 0.9/h for 20 s: 0.005 credits, past the budget
    other.heartbeat(held(again))
    reap_once(coordinator.ctx)
    ended = alice.deployment(d.id)
    assert (ended.state, ended.reason, ended.spent) == ("out_of_budget", "budget spent", 0.004)
    assert alice.balance().balance == pytest.approx(4.996)
    assert check_invariants(coordinator.ctx.settings.database_url) == []


def test_a_deployment_is_taken_by_its_name_wherever_its_id_is_and_chat_checks_it_before_a_prompt(
    coordinator, model_dir
):
    alice = coordinator.consumer("alice", deposit=5)
    model = upload_served_model(alice, model_dir)
    old = alice.deploy(spec(model, name="smol-tuned"))
    assert alice.deployment("smol-tuned").id == old.id
    assert alice.scale("smol-tuned", 2).replicas == 2
    assert alice.create_key("smol-tuned").deployment_id == old.id
    assert any("scaled from 1 to 2" in e.message for e in alice.deployment_logs("smol-tuned"))
    new = alice.deploy(spec(model, name="smol-tuned"))
    with pytest.raises(Conflict, match=f"deployment name smol-tuned is ambiguous: {old.id}, {new.id} are"):
        alice.deployment("smol-tuned")
    assert alice.stop_deployment(old.id).state == "cancelled"
    assert alice.deployment("smol-tuned").id == new.id  # the one still open
    assert alice.stop_deployment("smol-tuned").id == new.id
    with pytest.raises(Conflict, match="is ambiguous"):  # both ended: neither goes first
        alice.deployment("smol-tuned")
    with pytest.raises(NotFound):
        coordinator.consumer("bob").deployment("smol-tuned")

    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    who = ["--url", coordinator.url, "--token", token]
    chat = CliRunner().invoke(app, ["chat", "NOSUCH", *who], input="hello\n\n")
    assert isinstance(chat.exception, BadRequest) and "no deployment NOSUCH" in chat.exception.message
    assert "you>" not in chat.output  # refused before the first prompt


def test_a_model_not_stored_a_job_without_checkpoint_and_a_poor_wallet_are_refused(coordinator, model_dir):
    alice = coordinator.consumer("alice", deposit=1)
    model = upload_served_model(alice, model_dir)
    with pytest.raises(BadRequest, match=r"model\.from: the model directory is not uploaded"):
        alice.deploy(spec(model.model_copy(update={"uploaded": None})))
    with pytest.raises(InsufficientFunds, match="gpuflex wallet deposit"):
        alice.deploy(spec(model, budget=2.0))
    char = alice.submit(JobSpec.model_validate({"name": "c", "data": {"source": "none"}, "budget": 0.1}))
    with pytest.raises(BadRequest, match="recipe char-gpt, which is not a transformers model"):
        alice.deploy(DeploymentSpec.model_validate({"name": "d", "model": {"job": char.id}, "budget": 0.1}))
    scratch = {"recipe": "hf-causal-lm", "model": {"architecture": "llama", "n_embd": 32}}
    fresh = alice.submit(JobSpec.model_validate({"name": "s", "training": scratch, "budget": 0.1}))
    with pytest.raises(BadRequest, match="trained a model from scratch"):
        alice.deploy(DeploymentSpec.model_validate({"name": "d", "model": {"job": fresh.id}, "budget": 0.1}))
    tuned = {"recipe": "hf-causal-lm", "model": {"from": str(model_dir)}, "lora": {"r": 4}}
    hf = alice.submit(
        upload_model(alice, JobSpec.model_validate({"name": "h", "training": tuned, "budget": 0.1}))
    )
    from_job = DeploymentSpec.model_validate({"name": "d", "model": {"job": hf.id[:5]}, "budget": 0.1})
    with pytest.raises(Conflict, match="has no checkpoint yet"):
        alice.deploy(from_job)
    with coordinator.ctx.tx() as s:  # as a job that published a checkpoint has it
        s.execute(update(Job).where(Job.id == hf.id).values(checkpoint="c" * 64))
    pinned = alice.deployment(alice.deploy(from_job).id).spec.model
    assert (pinned.job, pinned.checkpoint, pinned.training.recipe) == (hf.id, "c" * 64, "hf-causal-lm")
    assert pinned.size == alice.job(hf.id).spec.training.model.size
    assert alice.deployments()[0].model == f"job {hf.id} (checkpoint cccccccccccc)"
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    deployed = CliRunner().invoke(
        app, ["deploy", hf.id[:5], "--budget", "0.1", "--url", coordinator.url, "--token", token]
    )
    assert deployed.exit_code == 0, deployed.output
    assert alice.deployments()[-1].name == "h"  # the job's name, not the prefix it was given by


def test_deploy_wait_returns_once_a_replica_answers_and_fails_when_the_deployment_ends_first(
    coordinator, model_dir
):
    alice = coordinator.consumer("alice", deposit=5)
    node = coordinator.node("n0", price=0.2)
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    deploy = ["deploy", "--model", str(model_dir), "--wait", "--budget", "1"]
    deploy += ["--url", coordinator.url, "--token", token]
    with ThreadPoolExecutor(1) as pool:
        deploying = pool.submit(CliRunner().invoke, app, deploy)
        replica = coordinator.task(wait_for(node.lease, 60, "the replica to be leased"))
        replica.relay_phase("loading")
        time.sleep(2)  # --wait looks every 0.5 s: it sees the replica load, and waits on
        assert not deploying.done()
        replica.relay_poll(0)
        deployed = deploying.result(timeout=30)
    assert deployed.exit_code == 0, deployed.output
    assert "starting: replica 0 loading the model" in deployed.output
    assert deployed.output.rstrip().endswith("answers: 1 of 1 replicas live"), deployed.output

    with ThreadPoolExecutor(1) as pool:  # n0 serves the first: this one waits for a node
        waiting = pool.submit(CliRunner().invoke, app, [*deploy, "--name", "never"])
        named = wait_for(lambda: [d for d in alice.deployments() if d.name == "never"], 30, "the deployment")
        alice.stop_deployment(named[0].id)
        ended = waiting.result(timeout=30)
    assert isinstance(ended.exception, BadRequest), ended.output
    assert "ended before a replica answered: cancelled: stopped by alice" in ended.exception.message


def test_the_deploy_clis_dtype_reaches_the_spec(coordinator, model_dir):
    alice = coordinator.consumer("alice", deposit=5)
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    who = ["--budget", "0.1", "--url", coordinator.url, "--token", token]
    for dtype in ("fp32", "auto"):
        deployed = CliRunner().invoke(app, ["deploy", "--model", str(model_dir), "--dtype", dtype, *who])
        assert deployed.exit_code == 0, deployed.output
        assert alice.deployment(alice.deployments()[-1].id).spec.dtype == dtype
    refused = CliRunner().invoke(app, ["deploy", "--model", str(model_dir), "--dtype", "int8", *who])
    assert isinstance(refused.exception, BadRequest)
    assert refused.exception.message == "--dtype int8: give one of auto, bf16, fp16, fp32"
    assert len(alice.deployments()) == 2  # refused before anything was uploaded or deployed


def test_a_deployment_no_online_gpu_can_hold_is_refused_before_its_model_is_uploaded(coordinator, model_dir):
    coordinator.node("core-1", core=True)
    coordinator.node("card", gpu=m.GpuInfo(name="Tiny GPU", vram_gb=0.5, compute_capability="8.6"))
    alice = coordinator.consumer("alice", deposit=5)
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    who = ["--url", coordinator.url, "--token", token]
    refused = CliRunner().invoke(app, ["deploy", "--model", str(model_dir), "--dtype", "fp32", *who])
    assert isinstance(refused.exception, BadRequest)
    message = refused.exception.message
    assert message.startswith("no online node can hold this deployment's replicas: a replica needs ≈ ")
    assert "the largest online GPU has 0.5 GB" in message
    assert alice.deployments() == []
    files = bundle_directory(model_dir, coordinator.ctx.settings.max_blob_bytes)[0].digests()
    assert set(alice.missing_blobs(files).keys) == set(files)  # none of its files was uploaded


def test_deploy_refuses_a_budget_short_of_a_minute_of_its_replicas_and_warns_of_one_short_of_an_hour(
    coordinator, model_dir
):
    coordinator.node("n0", price=0.2)
    coordinator.node("pricey", price=0.9)  # asks more than --max-price: not one it may take
    alice = coordinator.consumer("alice", deposit=5)
    token = alice.http._http.headers["Authorization"].removeprefix("Bearer ")
    deploy = ["deploy", "--model", str(model_dir), "--max-price", "0.5"]
    deploy += ["--url", coordinator.url, "--token", token]
    refused = CliRunner().invoke(app, [*deploy, "--budget", "0.0001"])
    assert isinstance(refused.exception, BadRequest), refused.output
    assert refused.exception.message == (
        "a budget of 0.0001 credits pays ≈ 2 s of 1 replicas at the cheapest online prices, 0.20 credits/h, "
        "not their first minute: give --budget 0.003334 or more"
    )
    assert alice.deployments() == []
    files = bundle_directory(model_dir, coordinator.ctx.settings.max_blob_bytes)[0].digests()
    assert set(alice.missing_blobs(files).keys) == set(files)  # refused before anything was uploaded
    warned = CliRunner().invoke(app, [*deploy, "--budget", "0.01"])
    assert warned.exit_code == 0, warned.output
    said = " ".join(warned.output.split())
    assert "the budget lasts ≈ 3 min of 1 replicas at the cheapest online prices, 0.20 credits/h" in said


def _serve(coordinator, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """What the gateway does as a request is let through and served under the key (a replica's job)."""
    with coordinator.ctx.tx() as s:
        deployment_keys.ensure_payable(s, key_id, context=2048)
    with coordinator.ctx.tx() as s:
        deployment_keys.count(s, key_id, prompt_tokens, completion_tokens)


def test_a_priced_key_is_paid_by_its_holder_to_the_owner_in_batches_never_past_its_wallet(
    coordinator, model_dir
):
    alice, bob = coordinator.consumer("alice", deposit=5), coordinator.consumer("bob", deposit=1)
    d = alice.deploy(spec(upload_served_model(alice, model_dir)))
    with pytest.raises(BadRequest, match="paid by another account"):
        alice.create_key(d.id, price_out=1)
    with pytest.raises(NotFound, match="no account named 'carol'"):
        alice.create_key(d.id, holder="carol", price_in=1)
    # 100 and 200 credits per 1M tokens: 100 micro-credits an input token, 200 an output one
    key = alice.create_key(d.id, holder="bob", price_in=100, price_out=200)
    assert (key.holder, key.price_in, key.price_out, key.accrued) == ("bob", 100, 200, 0)
    assert key.key is None and not key.claimed  # the owner never holds a secret that bob pays for
    with pytest.raises(NotFound, match=f"no API key {key.id} made for alice"):
        alice.claim_key(key.id)
    assert bob.claim_key(key.id).key.startswith("gfxkey_")
    with pytest.raises(Conflict, match="claimed already"):
        bob.claim_key(key.id)
    wallets = alice.balance().balance, bob.balance().balance

    for _ in range(3):  # 0.2 credits each; the most one request may cost: 2048 tokens at 200, 0.4096
        _serve(coordinator, key.id, 1000, 500)
    with pytest.raises(InsufficientFunds, match=r"holds 1.00 credits, owes 0.60 .* up to 0.4096"):
        _serve(coordinator, key.id, 1000, 500)  # 0.4 owed + 0.4096 fit in 1 credit; 0.6 + 0.4096 do not
    reap_once(coordinator.ctx)  # not due yet: a batch is at most every usage_settle_interval_s
    assert bob.balance().balance == wallets[1]
    coordinator.clock.advance(61)
    reap_once(coordinator.ctx)
    reap_once(coordinator.ctx)  # nothing new owed: no second entry
    assert (alice.balance().balance, bob.balance().balance) == pytest.approx((wallets[0] + 0.6, 0.4))
    bob.deposit(0.6)
    _serve(coordinator, key.id, 1000, 500)
    _serve(coordinator, key.id, 0, 1000)
    stopped = alice.stop_deployment(d.id)  # settles what the keys owe now: 0.4
    assert bob.balance().balance == pytest.approx(0.6)
    assert alice.balance().balance == pytest.approx(wallets[0] + 0.6 + 0.4 + stopped.budget - stopped.spent)

    with coordinator.ctx.tx() as s:  # a long request in flight at the stop, served after it: 1 credit
        deployment_keys.count(s, key.id, 0, 5000)
    coordinator.clock.advance(61)
    reap_once(coordinator.ctx)  # bob pays what his wallet holds, never more
    assert bob.balance().balance == 0
    account_token, shown = alice.deployment(d.id).keys
    assert (shown.requests, shown.accrued, shown.settled) == (6, pytest.approx(2.0), pytest.approx(1.6))
    assert account_token.account_token and account_token.holder == "alice" and account_token.requests == 0
    with coordinator.ctx.tx() as s:
        bob_wallet = accounts.consumer(s.scalars(select(Account.id).where(Account.name == "bob")).one())
        usage = [e for e in ledger.entries(s) if e.kind == "usage"]
    assert [dict(e.postings)[bob_wallet] for e in usage] == [
        -600_000,
        -400_000,
        -600_000,
    ]  # one entry a batch
    assert all(key.id in e.memo and d.id in e.memo for e in usage)
    public_key = coordinator.ctx.ledger_key.public_key_hex
    assert check_invariants(coordinator.ctx.settings.database_url, ledger_public_key=public_key) == []
