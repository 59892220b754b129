"""The dashboard's pages over HTTP: what each shows, who may see it, and clear 4xx pages on bad input."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import update

from gpuflex.cli.deploy import upload_served_model
from gpuflex.coordinator.app import reap_once
from gpuflex.coordinator.db import JournalEntry
from gpuflex.coordinator.web.stats import ddp_bytes
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import register_node, save_llama

from .helpers import MODEL_PARAMS, text_of


def test_the_overview_and_providers_are_public_and_show_no_ones_earnings(web, running_job):
    web.node("<b>evil</b>", price=0.3)
    visitor = web.browser()
    overview = visitor.get("/dashboard")
    assert overview.status_code == 200
    tiles = dict(
        re.findall(
            r'data-tile="(\w+)">\s*<div class="label">[^<]*</div>\s*<div class="value">([^<]*)<',
            overview.text,
        )
    )
    assert tiles["nodes"] == "4" and tiles["jobs"] == "1" and tiles["gpus"] == "0"
    assert tiles["price"] == "0.205"  # median of 0.10, 0.11, 0.30, 0.40
    assert tiles["bytes"].endswith("kB")
    assert "Sign in" in overview.text and "tiny-gpt" not in overview.text
    providers = visitor.get("/dashboard/providers").text
    assert all(name in providers for name in ("core-1", "box-0", "box-1"))
    assert "&lt;b&gt;evil&lt;/b&gt;" in providers and "<b>evil</b>" not in providers
    assert providers.count(">private<") == 4


def test_providers_show_the_reliability_the_market_ranks_by(web, running_job):
    web.clock.advance(60)  # a minute without heartbeats: uptime, hence reliability, has fallen
    offered = {o.node_id: o.reliability for o in running_job.alice.offers()}
    providers = web.browser().get("/dashboard/providers").text
    shown = re.findall(r'<tr data-node="([^"]+)">(?:.*?<td class="num">){4}(\d+)%</td>', providers, re.S)
    assert {node_id for node_id, _ in shown} == set(offered)
    for node_id, percent in shown:  # read a moment apart: the score may have moved a hair
        assert abs(int(percent) - 100 * offered[node_id]) <= 1
        assert offered[node_id] < 0.675  # below a brand-new node's: it missed a minute of heartbeats


def test_pages_send_security_headers(web):
    response = web.browser().get("/dashboard")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"


def test_signing_in_keeps_the_token_in_a_strict_http_only_cookie(web, running_job):
    browser = web.browser()
    response = browser.post(
        "/dashboard/signin", data={"token": running_job.alice_token, "next": "/dashboard"}
    )
    assert response.status_code == 303 and response.headers["location"] == "/dashboard"
    cookie = response.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert "tiny-gpt" in browser.get("/dashboard/jobs").text
    out = browser.post("/dashboard/signout")
    assert out.status_code == 303
    assert 'gpuflex_token=""' in out.headers["set-cookie"] or "max-age=0" in out.headers["set-cookie"].lower()
    assert browser.get("/dashboard/jobs").status_code == 303


def test_a_bad_token_gets_the_sign_in_page_again_with_the_reason(web):
    browser = web.browser()
    for token, reason in (("gfx_not-a-real-token", "unknown API token"), ("hunter2", "starts with gfx_")):
        response = browser.post("/dashboard/signin", data={"token": token})
        assert response.status_code == 401
        assert reason in response.text and 'name="token"' in response.text
        assert "set-cookie" not in response.headers
    assert browser.post("/dashboard/signin", content=b"\xff\xfe").status_code == 401


def test_signed_out_visitors_are_sent_to_sign_in_and_back_only_to_the_dashboard(web, running_job):
    browser = web.browser()
    response = browser.get(f"/dashboard/jobs/{running_job.job_id}")
    assert response.status_code == 303
    assert response.headers["location"] == f"/dashboard/signin?next=/dashboard/jobs/{running_job.job_id}"
    form = browser.get(response.headers["location"]).text
    assert f'value="/dashboard/jobs/{running_job.job_id}"' in form
    for evil in ("https://evil.example/", "//evil.example/dashboard", "/v1/jobs", "/dashboard/../v1/jobs"):
        signed = browser.post("/dashboard/signin", data={"token": running_job.alice_token, "next": evil})
        assert signed.headers["location"] == "/dashboard/jobs"


def test_the_job_page_shows_rounds_workers_traffic_spend_timeline_and_verdicts(web, running_job):
    page = web.sign_in(running_job.alice_token).get(f"/dashboard/jobs/{running_job.job_id}")
    assert page.status_code == 200
    html = page.text
    assert "tiny-gpt" in html and 'class="badge running"' in html
    assert re.search(r'data-field="round">\s*1 / 5', html)
    assert re.search(r'data-field="workers">\s*2 / 2', html)
    rounds = text_of(html, "job-rounds")
    assert "contributed" in rounds and "training" in rounds and "box-0" in rounds and "box-1" in rounds
    assert "5 steps · loss 4.2000" in rounds
    assert f"{MODEL_PARAMS:,} parameters" in html
    assert "DDP would have sent" in html
    assert "of 2.00 credits" in html
    events = text_of(html, "job-events")
    assert "round 1 published" in events and "leased to box-0" in events
    assert "&lt;img src=x onerror=alert(1)&gt;" in events and "<img src=x" not in html
    assert "none yet" in text_of(html, "job-verdicts")
    assert 'id="loss-curve"' in html


def test_the_ddp_comparison_counts_every_workers_inner_steps(web, running_job):
    from gpuflex.coordinator.web.traffic import job_traffic

    with web.ctx.tx() as s:
        traffic = job_traffic(s, web.app.state.blob_info, running_job.job_id)
    assert traffic.params == MODEL_PARAMS
    assert traffic.ddp == ddp_bytes(MODEL_PARAMS, 3 * 5)  # three contributions of five steps
    assert traffic.exchanged > 0 and traffic.saving > 1


def test_the_live_json_has_one_point_per_published_round(web, running_job):
    live = web.sign_in(running_job.alice_token).get(f"/dashboard/jobs/{running_job.job_id}/live.json")
    assert live.status_code == 200
    data = live.json()
    assert (data["state"], data["round"], data["rounds"], data["finished"]) == ("running", 1, 5, False)
    assert [(p["round"], p["val_loss"]) for p in data["points"]] == [(0, 5.5), (1, 4.5)]


def test_another_consumer_never_sees_the_job(web, running_job):
    _, bob_token = web.consumer("bob", deposit=1)
    bob = web.sign_in(bob_token)
    job_id = running_job.job_id
    for path in ("/dashboard", "/dashboard/jobs", "/dashboard/ledger"):
        html = bob.get(path).text
        assert job_id not in html and "tiny-gpt" not in html, path
    page = bob.get(f"/dashboard/jobs/{job_id}")
    assert page.status_code == 404 and f"no job {job_id}" in page.text and "<html" in page.text
    assert bob.get(f"/dashboard/jobs/{job_id}/live.json").status_code == 404


def test_an_unknown_job_or_page_is_a_404_page(web, running_job):
    alice = web.sign_in(running_job.alice_token)
    for path in ("/dashboard/jobs/j-nope", "/dashboard/no-such-page"):
        response = alice.get(path)
        assert response.status_code == 404 and "Not found" in response.text, path


def test_the_ledger_verifies_the_chain_and_shows_your_own_entries(web, running_job):
    alice = web.sign_in(running_job.alice_token)
    html = alice.get("/dashboard/ledger").text
    assert "chain verified" in html and "2 entries" in html
    assert f'signed by key <span class="mono">{web.ctx.ledger_key.public_key_hex[:16]}' in html
    assert "deposit by alice" in html and f"budget of job {running_job.job_id} into escrow" in html
    assert "your wallet" in html and "escrow of tiny-gpt" in html
    with web.ctx.tx() as s:
        s.execute(update(JournalEntry).where(JournalEntry.seq == 1).values(memo="deposit by mallory"))
    tampered = alice.get("/dashboard/ledger").text
    assert "chain broken" in tampered and "seq 1: hash mismatch" in tampered


def _provider_link(web, node) -> str:
    response = node.http.request("POST", "/v1/nodes/dashboard-token")
    return response.json()["path"]


def test_a_provider_signs_in_with_a_signed_link_and_sees_only_its_own_earnings(web, running_job):
    box = running_job.workers[0]
    browser = web.browser()
    response = browser.get(_provider_link(web, box))
    assert response.status_code == 303 and response.headers["location"] == "/dashboard/provider"
    assert "httponly" in response.headers["set-cookie"].lower()
    page = browser.get("/dashboard/provider").text
    assert "box-0" in page and box.key.node_id in page and running_job.job_id in page
    assert "Earnings by job" in page and "worker" in page
    providers = browser.get("/dashboard/providers").text
    assert providers.count(">private<") == 2  # core-1 and box-1: not this node's to see
    ledger = browser.get("/dashboard/ledger").text
    assert "chain verified" in ledger and "deposit by alice" not in ledger
    assert browser.get("/dashboard/jobs").status_code == 303  # a node is not a consumer
    box.leave()  # a node that has left still sees what it earned
    assert web.browser().get(_provider_link(web, box)).status_code == 303


def test_provider_links_must_be_signed_fresh_and_untampered(web, running_job):
    box = running_job.workers[0]
    unsigned = web.browser().post("/v1/nodes/dashboard-token")
    assert unsigned.status_code == 401
    link = _provider_link(web, box)
    forged = web.browser().get(link[:-3] + ("AAA" if not link.endswith("AAA") else "BBB"))
    assert forged.status_code == 401 and "not valid" in forged.text
    web.clock.advance(web.ctx.settings.dashboard_link_ttl_s + 1)
    expired = web.browser().get(link)
    assert expired.status_code == 401 and "expired" in expired.text
    assert web.browser().get("/dashboard/provider").status_code == 401


def test_a_settled_job_shows_what_each_provider_was_paid_and_stops_refreshing(web, running_job):
    web.clock.advance(10)
    for node in (running_job.core, *running_job.workers):
        node.heartbeat([])
    running_job.alice.cancel(running_job.job_id)
    browser = web.browser()
    browser.get(_provider_link(web, running_job.workers[0]))
    page = browser.get("/dashboard/provider").text
    metered, paid = re.search(
        rf"{running_job.job_id}</td>.*?<td class=\"num\">[\d.]+</td>\s*"
        r"<td class=\"num\">([\d.]+)</td><td class=\"num\">([\d.]+)</td>",
        page,
        re.S,
    ).groups()
    fee = web.ctx.settings.platform_fee_bps / 10_000
    assert float(metered) > 0 and float(paid) == pytest.approx(float(metered) * (1 - fee), abs=2e-6)
    assert f'data-field="held">{paid}<' in page and 'data-field="balance">0.000000<' in page
    web.ctx.settings.audit_window_s = 30
    web.clock.advance(31)
    reap_once(web.ctx)
    page = browser.get("/dashboard/provider").text
    assert f'data-field="balance">{paid}<' in page and 'data-field="held">0.000000<' in page
    job_page = web.sign_in(running_job.alice_token).get(f"/dashboard/jobs/{running_job.job_id}").text
    assert 'class="badge cancelled"' in job_page and 'data-refresh-ms="0"' in job_page
    assert "open" not in text_of(job_page, "job-rounds")


def test_the_job_page_shows_why_a_worker_waits_and_that_it_never_ran(web):
    alice, token = web.consumer("alice", deposit=10)
    nodes = [web.node("core-1", core=True, price=0.4), *(web.node(f"box-{i}", price=0.1) for i in range(2))]
    spec = JobSpec.model_validate(
        {"name": "short", "resources": {"workers": 3, "min_workers": 2}, "training": {"rounds": 5}}
    )
    job = alice.submit(spec, alice.upload(b"corpus " * 2000))
    assert all(node.lease() for node in nodes)  # the aggregator and 2 of the 3 workers: the job runs

    def tasks() -> str:
        html = web.sign_in(token).get(f"/dashboard/jobs/{job.id}").text
        return " ".join(re.sub(r"<[^>]+>", " ", text_of(html, "job-tasks")).split())

    reap_once(web.ctx)
    assert "worker 2 pending not placed waits: no free node qualifies: box-" in tasks()
    assert "busy (worker, leased)" in tasks()
    alice.cancel(job.id)
    assert "worker 2 unplaced not placed never placed: no free node qualifies: box-" in tasks()


def test_a_dp_jobs_page_shows_the_epsilon_spent_its_target_and_delta(web):
    alice, token = web.consumer("alice", deposit=10)
    web.node("core-1", core=True, price=0.4)
    for i in range(2):
        owned = m.PrivateDataset(name="notes", tokens=1000 * (i + 1), shards=1, manifest=str(i) * 64)
        register_node(web.url, f"owner-{i}", price=0.1, private_data=[owned], consumers=["alice"])
    dp = {"clip": 0.5, "noise_multiplier": 1.5, "target_epsilon": 6, "delta": 1e-5}
    spec = JobSpec.model_validate({"name": "dp", "data": {"federated": "notes"}, "privacy": {"dp": dp}})
    job = alice.submit(spec)
    page = web.sign_in(token).get(f"/dashboard/jobs/{job.id}").text
    tile = " ".join(re.sub(r"<[^>]+>", " ", text_of(page, "job-privacy")).split())
    rounds = alice.job(job.id).privacy.rounds
    shown = f"> Privacy (ε spent) 0.000 target 6.0 · δ 1e-05 · clip 0.5 · noise ×1.5 · {rounds} rounds Loss"
    assert shown in tile, tile


def test_the_deployments_page_shows_replicas_nodes_traffic_spend_and_verdicts_to_their_owner_only(
    web, tmp_path
):
    alice, alice_token = web.consumer("alice", deposit=5)
    _, bob_token = web.consumer("bob")
    model = upload_served_model(alice, save_llama(tmp_path / "m", ["alpha beta. " * 20]))
    body = {"name": "web-chat", "model": model.model_dump(exclude_none=True), "replicas": 2, "budget": 1}
    d = alice.deploy(DeploymentSpec.model_validate({**body, "max_price_per_hour": 0.5}))
    grant = web.node("box-0", price=0.1).lease()  # one replica runs; one node takes one replica
    web.task(grant).relay_poll(0)  # its model loaded: it answers

    html = web.sign_in(alice_token).get("/dashboard/deployments").text
    assert 'href="/dashboard/deployments" class="active"' in html  # linked from the nav
    shown = text_of(html, f"deployment-{d.id}")
    replicas = re.findall(r"<tr><td>(\d)</td><td>(\w+)</td>\s*<td>([^<]*)", shown)
    assert replicas == [("0", "leased", "box-0 "), ("1", "pending", "")] and "waiting for a node" in shown
    tiles = dict(re.findall(r'data-field="(\w+)">([^<]*)<', shown))
    assert tiles["replicas"] == "1 / 2" and tiles["rps"] == tiles["tps"] == tiles["latency"] == "–"
    assert "of 1" in shown and "keys earned 0" in shown  # spend vs budget; nothing served under a key
    assert "Verdicts" in shown and "none yet" in shown
    other = web.sign_in(bob_token).get("/dashboard/deployments").text
    assert "web-chat" not in other and d.id not in other and "No deployments yet" in other
    assert web.browser().get("/dashboard/deployments").status_code == 303  # signed out: to sign in
