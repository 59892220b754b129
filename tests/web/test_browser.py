"""The dashboard in a real browser while a real job runs: Playwright driving Debian's Chromium.

A coordinator and three agents run as processes on loopback (as in ``tests/integration``); a job
with many rounds trains while the test signs in and visits every page. Screenshots of each page are
saved under ``test-artifacts/screenshots/`` for people to look at. Chromium is never downloaded:
``scripts/ensure-chromium`` (run by ``make test``) installs Debian's package, else this test skips.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpuflex.client import Client
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import save_llama, small_job, wait_for, write_corpus

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
SETTINGS = {"GPUFLEX_HEARTBEAT_INTERVAL_S": "1", "GPUFLEX_LEASE_TTL_S": "8", "GPUFLEX_LOG_FORMAT": "json"}
WAIT_MS = 30_000


def _playwright():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: run scripts/ensure-chromium as root (make test does)")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[dev]')")
    expect.set_options(timeout=WAIT_MS)
    return sync_playwright


def _spec(data_dir: Path) -> JobSpec:
    """Many short rounds: the job is still running when the test is done looking."""
    return small_job(data_dir, name="browser-gpt", workers=2, rounds=500, inner_steps=8, batch_size=8)


def _start(net: LocalNetwork, data_dir: Path) -> tuple[Client, str, str, str]:
    """The network, alice with a running job, and bob; returns (alice, alice's token, bob's token, job id)."""
    from gpuflex.cli.inputs import upload_inputs

    url = net.start_coordinator()
    net.start_agent("core", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
    net.start_agent("c0", price=0.10)
    net.start_agent("c1", price=0.12)
    alice_token = Client(url).create_account("alice").token
    bob_token = Client(url).create_account("bob").token
    alice = Client(url, alice_token)
    alice.deposit(5)
    wait_for(lambda: sum(o.state == "online" for o in alice.offers()) == 3, 90, "the agents to register")
    spec = _spec(data_dir)
    job_id = alice.submit(spec, **upload_inputs(alice, spec)).id
    wait_for(lambda: alice.job(job_id).round >= 3, 120, f"round 3 of {job_id}")
    return alice, alice_token, bob_token, job_id


def _gpuflex(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gpuflex", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def _sign_in(page, url: str, token: str) -> None:
    page.goto(f"{url}/dashboard/signin")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/dashboard/jobs")


def _visit_sign_in_with_a_bad_token(page, url: str) -> None:
    page.goto(f"{url}/dashboard/signin")
    page.fill("#token", "gfx_this-is-not-a-token")
    page.click("button[type=submit]")
    assert "unknown API token" in page.inner_text("[role=alert]")
    _shot(page, "signin-error")


def _visit_overview(page, url: str) -> None:
    page.goto(f"{url}/dashboard")
    tiles = {t: page.inner_text(f"[data-tile={t}] .value") for t in ("nodes", "jobs", "price", "bytes")}
    assert tiles["nodes"] == "3" and tiles["jobs"] == "1", tiles
    assert tiles["price"] == "0.120", tiles  # median of 0.10, 0.12, 0.40
    assert re.fullmatch(r"[\d.]+ (kB|MB)", tiles["bytes"]), tiles
    assert "browser-gpt" in page.inner_text("#overview-jobs")
    _shot(page, "overview")


def _visit_providers(page, url: str) -> None:
    page.goto(f"{url}/dashboard/providers")
    table = page.inner_text("#providers-table")
    for name in ("core", "c0", "c1"):
        assert re.search(rf"^{name}\b", table, re.M), table
    assert table.count("online") == 3 and table.count("private") == 3
    _shot(page, "providers")


def _visit_jobs(page, url: str, job_id: str) -> None:
    page.goto(f"{url}/dashboard/jobs")
    row = page.inner_text(f"tr[data-job='{job_id}']")
    assert "browser-gpt" in row and "running" in row and "/ 500" in row
    _shot(page, "jobs")


def _visit_job(page, url: str, job_id: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{url}/dashboard/jobs/{job_id}")
    assert page.inner_text("h1 .job-name") == "browser-gpt"
    assert page.inner_text("[data-field=state]") == "running"
    first = int(page.inner_text("[data-field=round]").split("/")[0])
    assert first >= 3
    expect(page.locator("#loss-curve")).to_have_attribute("data-points", re.compile(r"^([4-9]|\d\d+)$"))
    points = page.get_attribute("#loss-curve polyline.val", "points")
    assert len(points.split()) >= 4, points
    assert "contributed" in page.inner_text("#job-rounds")
    assert "c0" in page.inner_text("#job-tasks") and "c1" in page.inner_text("#job-tasks")
    assert "DDP would have sent" in page.inner_text("#job-tiles")
    assert "leased to" in page.inner_text("#job-events")
    # honest providers: nobody convicted (an audit that cleared a contribution may be listed)
    assert page.locator("#job-verdicts .badge.guilty").count() == 0, page.inner_text("#job-verdicts")
    # The page refreshes itself: a later round shows up without a reload.
    expect(page.locator("[data-field=round]")).not_to_have_text(re.compile(rf"^\s*{first} /"))
    _shot(page, "job")


def _deploy(alice: Client, directory: Path) -> str:
    """A deployment no agent takes (it offers less than any asks): its page shows a replica waiting."""
    from gpuflex.cli.deploy import upload_served_model

    model = upload_served_model(alice, save_llama(directory, ["alpha beta. " * 20]))
    body = {"name": "browser-chat", "model": model.model_dump(exclude_none=True), "budget": 0.5}
    return alice.deploy(DeploymentSpec.model_validate({**body, "max_price_per_hour": 0.01})).id


def _visit_deployments(page, url: str, deployment_id: str) -> None:
    page.goto(f"{url}/dashboard/jobs")
    page.click("nav a[href='/dashboard/deployments']")
    page.wait_for_url(f"{url}/dashboard/deployments")
    shown = page.inner_text(f"[data-deployment='{deployment_id}']")
    assert "browser-chat" in shown and "waiting for a node" in shown, shown
    assert "Verdicts" in shown and "none yet" in shown, shown
    assert page.inner_text(f"[data-deployment='{deployment_id}'] [data-field=replicas]") == "0 / 1"
    _shot(page, "deployments")


def _visit_ledger(page, url: str, job_id: str) -> None:
    page.goto(f"{url}/dashboard/ledger")
    assert "chain verified" in page.inner_text("#chain-status")
    assert f"budget of job {job_id} into escrow" in page.inner_text("main")
    _shot(page, "ledger")


def _as_bob(page, url: str, bob_token: str, job_id: str) -> None:
    _sign_in(page, url, bob_token)
    for path in ("/dashboard", "/dashboard/jobs", "/dashboard/deployments", "/dashboard/ledger"):
        page.goto(f"{url}{path}")
        text = page.inner_text("body")
        assert "browser-gpt" not in text and job_id not in text and "browser-chat" not in text, path
    response = page.goto(f"{url}/dashboard/jobs/{job_id}")
    assert response.status == 404 and "Not found" in page.inner_text("h1")
    _shot(page, "another-consumer-404")


def _as_provider(page, link: str, job_id: str) -> None:
    page.goto(link)
    assert page.url.endswith("/dashboard/provider")
    assert page.inner_text("h1").startswith("c0")
    assert job_id in page.inner_text("#provider-main")
    assert "chain verified" in page.inner_text("#chain-status")
    _shot(page, "provider")


def _check_metrics_and_logs(net: LocalNetwork) -> None:
    metrics = httpx.get(f"{net.url}/metrics", timeout=10).text
    assert 'gpuflex_jobs{state="running"} 1.0' in metrics
    granted = float(re.search(r"^gpuflex_leases_granted_total (\S+)", metrics, re.M).group(1))
    assert granted >= 3
    log = (net.root / "logs" / "coordinator.log").read_text()
    assert re.search(r'^\{.*"msg": "lease granted".*"job_id": "j-', log, re.M), log[-2000:]
    assert re.search(r'^\{.*"msg": "round published".*"round": 3', log, re.M), log[-2000:]
    agent = (net.root / "logs" / "c0.log").read_text()
    assert re.search(r'^\{.*"logger": "gpuflex.agent".*"node_id": "n-', agent, re.M), agent[-2000:]


def test_every_page_in_a_real_browser_while_a_job_runs(tmp_path):
    sync_playwright = _playwright()
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    write_corpus(tmp_path / "data")
    with LocalNetwork(tmp_path / "net", settings=SETTINGS) as net:
        alice, alice_token, bob_token, job_id = _start(net, tmp_path / "data")
        deployment_id = _deploy(alice, tmp_path / "model")
        url = net.url
        link = _gpuflex("provider", "dashboard", "--data-dir", str(net.root / "agents" / "c0"), "--url", url)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            view = {"viewport": {"width": 1360, "height": 900}}
            alice_page = browser.new_context(**view).new_page()
            alice_page.set_default_timeout(WAIT_MS)
            _visit_sign_in_with_a_bad_token(alice_page, url)
            _sign_in(alice_page, url, alice_token)
            _visit_jobs(alice_page, url, job_id)
            _visit_overview(alice_page, url)
            _visit_providers(alice_page, url)
            _visit_job(alice_page, url, job_id)
            _visit_deployments(alice_page, url, deployment_id)
            _visit_ledger(alice_page, url, job_id)
            _as_bob(browser.new_context(**view).new_page(), url, bob_token, job_id)
            _as_provider(browser.new_context(**view).new_page(), link.strip(), job_id)
            browser.close()
        _check_metrics_and_logs(net)
        report = ARTIFACTS / "report" / "report.png"
        _gpuflex("job", "report", job_id, "-o", str(report), "--url", url, "--token", alice_token)
        assert report.read_bytes()[:4] == b"\x89PNG" and "c0" in report.with_suffix(".csv").read_text()
        assert alice.job(job_id).state == "running"
