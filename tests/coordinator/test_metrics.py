"""``GET /metrics``: what happened (counters), how long requests took (by route template), what the
OpenAI gateway refused per deployment, and the database's jobs and nodes by state, read at scrape time."""

from __future__ import annotations

import logging
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from gpuflex.cli.deploy import upload_served_model
from gpuflex.coordinator.app import create_app, reap_once
from gpuflex.coordinator.db import make_engine, make_sessionmaker
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import save_llama

CORPUS = b"corpus " * 2000
MODEL = b"\x00" * 4096


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _scrape(http) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return _parse(response.text)


def _value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _running_job(coordinator):
    alice = coordinator.consumer("alice", deposit=10)
    nodes = [coordinator.node("core", core=True, price=0.4), coordinator.node("c0"), coordinator.node("c1")]
    spec = JobSpec.model_validate({"name": "m", "resources": {"workers": 2}, "training": {"rounds": 3}})
    job = alice.submit(spec, alice.upload(CORPUS))
    grants = [n.lease() for n in nodes]
    aggregator = coordinator.task(grants[0])
    state = aggregator.put_blob(MODEL)
    aggregator.publish_round(m.RoundPublish(round=0, state_hash="0" * 64, checkpoint=state, val_loss=5.0))
    coordinator.task(grants[1]).get_blob(state)
    for node in nodes:
        node.heartbeat([])
    return job, nodes


def test_metrics_count_leases_heartbeats_rounds_bytes_and_jobs_by_state(coordinator):
    assert _value(_scrape(coordinator.http), "gpuflex_jobs", state="running") == 0
    _running_job(coordinator)
    samples = _scrape(coordinator.http)
    assert _value(samples, "gpuflex_database_up") == 1
    assert _value(samples, "gpuflex_jobs", state="running") == 1
    assert _value(samples, "gpuflex_jobs", state="pending") == 0
    assert _value(samples, "gpuflex_nodes", kind="community", state="online") == 2
    assert _value(samples, "gpuflex_nodes", kind="core", state="online") == 1
    assert _value(samples, "gpuflex_leases_granted_total") == 3
    assert _value(samples, "gpuflex_heartbeats_total") == 3
    assert _value(samples, "gpuflex_rounds_published_total") == 1
    assert _value(samples, "gpuflex_blob_bytes_in_total") == len(CORPUS) + len(MODEL)
    assert _value(samples, "gpuflex_blob_bytes_out_total") == len(MODEL)


def test_request_latency_is_labelled_by_route_template_method_and_status(coordinator):
    job, _ = _running_job(coordinator)
    coordinator.http.get(f"/v1/jobs/{job.id}", headers={"Authorization": "Bearer gfx_wrong"})
    samples = _scrape(coordinator.http)
    count = "gpuflex_http_request_duration_seconds_count"
    assert _value(samples, count, route="/v1/nodes/lease", method="POST", status="200") == 3
    assert _value(samples, count, route="/v1/jobs", method="POST", status="201") == 1
    assert _value(samples, count, route="/v1/jobs/{job_id}", method="GET", status="401") == 1
    routes = {dict(labels).get("route", "") for name, labels in samples if name == count}
    assert not any(job.id in r for r in routes), routes


def test_expired_leases_are_counted_and_logged_with_their_ids(coordinator, caplog):
    job, nodes = _running_job(coordinator)
    metrics = create_app(ctx=coordinator.ctx).state.metrics  # a replica's reaper, run by hand
    coordinator.clock.advance(coordinator.ctx.settings.lease_ttl_s + 1)
    with caplog.at_level(logging.INFO, logger="gpuflex.coordinator"):
        reap_once(coordinator.ctx, metrics)
    assert _value(_parse(metrics.exposition().decode()), "gpuflex_leases_expired_total") == 3
    expired = [r for r in caplog.records if r.getMessage() == "lease expired"]
    assert {r.job_id for r in expired} == {job.id}
    assert {r.node_id for r in expired} == {n.key.node_id for n in nodes}


def test_each_app_has_its_own_registry_but_reads_the_same_database(coordinator):
    _running_job(coordinator)
    samples = _parse(create_app(ctx=coordinator.ctx).state.metrics.exposition().decode())
    assert _value(_scrape(coordinator.http), "gpuflex_leases_granted_total") == 3
    assert _value(samples, "gpuflex_leases_granted_total") == 0
    assert _value(samples, "gpuflex_jobs", state="running") == 1


def test_a_scrape_still_answers_when_the_database_does_not(coordinator, tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'missing' / 'dir' / 'db.sqlite'}")
    ctx = replace(coordinator.ctx, engine=engine, sessions=make_sessionmaker(engine))
    samples = _parse(create_app(ctx=ctx).state.metrics.exposition().decode())
    assert _value(samples, "gpuflex_database_up") == 0
    assert not any(name == "gpuflex_jobs" for name, _ in samples)


def test_gateway_refusals_are_counted_per_deployment_by_openai_error_type_and_status(coordinator, tmp_path):
    alice = coordinator.consumer("alice", deposit=5)
    bob = coordinator.consumer("bob")  # holds a priced key with an empty wallet
    model = upload_served_model(alice, save_llama(tmp_path / "m", ["alpha beta. " * 20]))
    spec = DeploymentSpec.model_validate(
        {"name": "chat", "model": model.model_dump(exclude_none=True), "budget": 1}
    )
    d = alice.deploy(spec)
    priced = bob.claim_key(alice.create_key(d.id, holder="bob", price_out=1).id).key  # bob's wallet is empty
    own = alice.create_key(d.id).key  # no replica is placed: nobody serves it
    body = {"model": d.id, "messages": [{"role": "user", "content": "alpha"}], "max_tokens": 2}
    said = {}
    for name, key, model_name in (
        ("unpaid", priced, d.id),
        ("unserved", own, d.id),
        ("unknown", own, "nope"),
    ):
        headers = {"Authorization": f"Bearer {key}"}
        response = coordinator.http.post(
            "/v1/chat/completions", json={**body, "model": model_name}, headers=headers
        )
        said[name] = (response.status_code, response.json()["error"]["type"])
    assert said == {
        "unpaid": (402, "insufficient_quota"),
        "unserved": (503, "invalid_request_error"),
        "unknown": (404, "invalid_request_error"),
    }
    samples = _scrape(coordinator.http)
    errors = "gpuflex_deployment_errors_total"
    assert _value(samples, errors, deployment=d.id, type="insufficient_quota", status="402") == 1
    assert _value(samples, errors, deployment=d.id, type="invalid_request_error", status="503") == 1
    assert _value(samples, errors, deployment="unknown", type="invalid_request_error", status="404") == 1
    assert _value(samples, "gpuflex_deployment_requests_total", deployment=d.id) == 0  # none was served
