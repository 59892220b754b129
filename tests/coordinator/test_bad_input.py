"""Every kind of bad input gets a 4xx with a message, and writes nothing."""

import hashlib
import re

import httpx
import pytest

from gpuflex.auth.signing import NodeKey, canonical_message
from gpuflex.client import NodeClient
from gpuflex.coordinator.routes.openai import MAX_BODY_BYTES
from gpuflex.errors import BadRequest, Conflict, Forbidden, InsufficientFunds, NotFound, Unauthorized
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

from .conftest import running_coordinator


def _status(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["detail"]


def test_sign_up_names_must_be_valid_and_unique(coordinator):
    coordinator.consumer("alice")
    assert coordinator.http.post("/v1/accounts", json={"name": "alice"}).status_code == 409
    code, detail = _status(coordinator.http.post("/v1/accounts", json={"name": "no spaces!"}))
    assert code == 422 and "name" in detail


@pytest.mark.parametrize("header", [None, "Bearer gfx_not-a-real-token", "Bearer gfxtask_x", "Basic abc"])
def test_consumer_endpoints_need_a_valid_api_token(coordinator, header):
    headers = {"Authorization": header} if header else {}
    code, detail = _status(coordinator.http.get("/v1/jobs", headers=headers))
    assert code == 401 and "token" in detail


def test_malformed_json_wrong_types_and_unknown_fields_are_422(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    auth = alice.http._http.headers
    as_json = {**auth, "Content-Type": "application/json"}
    code, detail = _status(coordinator.http.post("/v1/wallet/deposit", content=b"{not json", headers=as_json))
    assert code == 422 and "JSON" in detail
    code, detail = _status(coordinator.http.post("/v1/wallet/deposit", json={"amount": "lots"}, headers=auth))
    assert code == 422 and "amount" in detail
    code, detail = _status(coordinator.http.post("/v1/wallet/deposit", json={"amount": -3}, headers=auth))
    assert code == 422 and "amount" in detail
    nan = b'{"amount": NaN}'
    code, detail = _status(coordinator.http.post("/v1/wallet/deposit", content=nan, headers=as_json))
    assert code == 422 and "amount" in detail
    dataset = alice.upload(b"x" * 1000)
    body = {"spec": {"name": "j", "training": {"roundz": 2}}, "dataset": dataset}
    code, detail = _status(coordinator.http.post("/v1/jobs", json=body, headers=auth))
    assert code == 422 and "spec.training.roundz: unknown field" in detail
    assert alice.jobs() == [] and alice.balance().balance == 5


def test_oversized_bodies_get_413(coordinator):
    alice = coordinator.consumer("alice")
    auth = alice.http._http.headers
    huge = b'{"name": "' + b"a" * 100_000 + b'"}'
    assert coordinator.http.post("/v1/accounts", content=huge).status_code == 413
    blob = b"z" * (300 * 1024)
    response = coordinator.http.put(
        f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=blob, headers=auth
    )
    assert response.status_code == 413


def test_submitting_beyond_the_wallet_is_refused_and_writes_nothing(coordinator):
    alice = coordinator.consumer("alice", deposit=1)
    entries_before = len(alice.ledger().entries)
    dataset = alice.upload(b"x" * 1000)
    with pytest.raises(
        InsufficientFunds, match=r"your wallet holds 1.00 credits and this job's budget is 50.00: add 49.00"
    ):
        alice.submit(JobSpec(name="big", budget=50), dataset)
    assert alice.jobs() == []
    assert alice.balance().balance == 1
    assert len(alice.ledger().entries) == entries_before


def test_a_job_needs_its_dataset_uploaded_first(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    with pytest.raises(BadRequest, match="upload it first"):
        alice.submit(JobSpec(name="j", budget=1), "ab" * 32)


def test_consumers_see_and_touch_only_their_own_jobs(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    bob = coordinator.consumer("bob", deposit=5)
    job = alice.submit(JobSpec(name="mine", budget=1), alice.upload(b"x" * 1000))
    for action in (bob.job, bob.cancel, bob.logs, bob.checkpoint):
        with pytest.raises(NotFound, match=job.id):
            action(job.id)
    assert bob.jobs() == []
    assert alice.job(job.id).state in ("pending", "scheduled")
    with pytest.raises(NotFound):
        alice.job("j-doesnotexist")


def test_blob_keys_hashes_and_readers_are_checked(coordinator):
    alice = coordinator.consumer("alice")
    auth = alice.http._http.headers
    wrong = hashlib.sha256(b"other").hexdigest()
    code, detail = _status(coordinator.http.put(f"/v1/blobs/{wrong}", content=b"data", headers=auth))
    assert code == 400 and "hashes to" in detail
    assert coordinator.http.put(f"/v1/blobs/{wrong}", content=b"other").status_code == 401
    digest = alice.upload(b"data")
    with pytest.raises(Forbidden):
        alice.http.request("GET", f"/v1/blobs/{digest}")


def test_node_requests_must_be_signed_fresh_and_never_replayed(coordinator):
    node = coordinator.node("n1")
    assert node.lease() is None  # a good signature works
    signed = node.key.sign_request("POST", "/v1/nodes/lease", b"")
    first = coordinator.http.post("/v1/nodes/lease", headers=signed)
    assert first.status_code == 204
    code, detail = _status(coordinator.http.post("/v1/nodes/lease", headers=signed))
    assert code == 401 and "replayed" in detail
    forged = {**node.key.sign_request("POST", "/v1/nodes/lease", b""), "X-GPUFlex-Signature": "00" * 64}
    code, detail = _status(coordinator.http.post("/v1/nodes/lease", headers=forged))
    assert code == 401 and "signature" in detail
    stranger = NodeKey.generate().sign_request("POST", "/v1/nodes/lease", b"")
    code, detail = _status(coordinator.http.post("/v1/nodes/lease", headers=stranger))
    assert code == 401 and "register first" in detail


def test_signed_requests_from_a_skewed_clock_are_refused(coordinator):
    node = coordinator.node("n1")
    coordinator.clock.advance(3600)
    with pytest.raises(Unauthorized, match="timestamp"):
        node.lease()


def test_core_registration_needs_the_operator_token(coordinator):
    key = NodeKey.generate()
    with pytest.raises(Forbidden, match="core token"):
        NodeClient(coordinator.url, key).register(
            m.NodeRegister(
                name="fake-core",
                public_key=key.public_key_hex,
                kind="core",
                core_token="guess",
                price_per_hour=0.1,
                hardware=m.HardwareProfile(cpu_model="x", cpu_cores=1, ram_gb=1),
                benchmark=m.BenchmarkResult(tflops_fp32=1, mem_bandwidth_gbps=1),
            )
        )
    assert coordinator.node("real-core", core=True) is not None


def test_cancel_twice_is_a_conflict(coordinator):
    alice = coordinator.consumer("alice", deposit=5)
    job = alice.submit(JobSpec(name="j", budget=1), alice.upload(b"x" * 1000))
    assert alice.cancel(job.id).state == "cancelled"
    with pytest.raises(Conflict, match="already ended"):
        alice.cancel(job.id)
    assert alice.balance().balance == 5


def test_the_api_documents_itself(coordinator):
    assert coordinator.http.get("/docs").status_code == 200
    paths = coordinator.http.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/nodes/register", "/v1/blobs/{digest}", "/v1/ledger/export"} <= set(paths)


# Keys that try to leave the blob directory: dot segments plain and percent-encoded, absolute paths,
# separators, and keys that are not 64 lower-case hex digits.
TRAVERSALS = [
    "..",
    "../secret",
    "..%2Fsecret",
    "%2e%2e%2fsecret",
    "%2E%2E/%2E%2E/secret",
    "%2Fetc%2Fpasswd",
    "..%5csecret",
    "ab%2F" + "a" * 62,
    "A" * 64,
    "g" * 64,
    "a" * 63,
    "a" * 65,
    "a" * 64 + "%0a",
    "a" * 64 + "%00",
]


def test_blob_keys_that_try_to_leave_the_store_are_refused(coordinator):
    data_dir = coordinator.ctx.settings.data_dir
    (data_dir / "secret").write_bytes(b"the operator's secret")
    alice = coordinator.consumer("alice")
    node = coordinator.node("reader")
    before = set(data_dir.rglob("*"))
    for key in TRAVERSALS:
        put = coordinator.http.put(f"/v1/blobs/{key}", content=b"data", headers=alice.http._http.headers)
        request = coordinator.http.build_request("GET", f"/v1/blobs/{key}")
        request.headers.update(node.key.sign_request("GET", request.url.raw_path.decode(), b""))
        get = coordinator.http.send(request)
        for response in (put, get):
            assert 400 <= response.status_code < 500, (key, response.status_code, response.text)
            assert b"secret" not in response.content, key
    assert not set(data_dir.rglob("*")) - before, "nothing may be written, in the store or outside it"


def _chunks(data: bytes, size: int = 4096):
    """A body httpx sends chunked, with no Content-Length to check up front."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_chunked_bodies_without_a_length_are_limited_while_they_stream(coordinator):
    alice = coordinator.consumer("alice")
    auth = dict(alice.http._http.headers)
    huge = b'{"name": "' + b"a" * 100_000 + b'"}'
    response = coordinator.http.post(
        "/v1/accounts", content=_chunks(huge), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413 and "larger than" in response.json()["detail"]
    assert "content-length" not in response.request.headers
    blob = b"z" * (300 * 1024)
    put = coordinator.http.put(
        f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=_chunks(blob), headers=auth
    )
    assert put.status_code == 413
    small = b"z" * (100 * 1024)  # over the JSON limit, under the blob limit: each path has its own
    digest = hashlib.sha256(small).hexdigest()
    assert (
        coordinator.http.put(f"/v1/blobs/{digest}", content=_chunks(small), headers=auth).status_code == 201
    )


# The OpenAI gateway checks the key before it reads a body: a stranger's is never read (a 401), a caller's is
# read up to the routes' own limit and refused past it as OpenAI's error object.
GATEWAY_BODIES = ("/v1/completions", "/v1/chat/completions")


def test_every_operation_that_takes_a_body_limits_it(coordinator):
    """Every body path of the schema, sent chunked past its limit by a stranger: 413 before anything (a
    blob upload and the gateway's bodies are read only once the caller is known: sent by one)."""
    limits = coordinator.ctx.settings
    token = coordinator.http.post("/v1/accounts", json={"name": "caller"}).json()["token"]
    for path, methods in coordinator.http.get("/openapi.json").json()["paths"].items():
        for method, operation in methods.items():
            if "requestBody" not in operation:
                continue
            url = re.sub(r"{[^}]+}", "a" * 64, path)
            large = path in ("/v1/blobs/{digest}", "/v1/task/relay/events")
            limit = limits.max_blob_bytes if large else limits.max_request_bytes
            headers = {"Authorization": f"Bearer {token}"} if path == "/v1/blobs/{digest}" else {}
            if path in GATEWAY_BODIES:
                headers, limit = {"Authorization": f"Bearer {token}"}, MAX_BODY_BYTES
            body = _chunks(b"{" + b" " * limit + b"}")
            response = coordinator.http.request(method, url, content=body, headers=headers)
            assert response.status_code == 413, (method, path, response.status_code, response.text)
            if path in GATEWAY_BODIES:
                assert response.json()["error"]["message"] == f"the body is over {limit} bytes"


def test_signed_requests_outside_the_skew_window_are_refused(coordinator):
    node = coordinator.node("n1")
    skew = coordinator.ctx.settings.signature_max_skew_s
    for offset in (-skew - 5, skew + 5):
        signed = node.key.sign_request("POST", "/v1/nodes/lease", b"")
        stamp = float(signed["X-GPUFlex-Timestamp"]) + offset
        # re-sign with the moved timestamp, so only its age is wrong
        message = canonical_message("POST", "/v1/nodes/lease", b"", f"{stamp:.3f}", signed["X-GPUFlex-Nonce"])
        signed["X-GPUFlex-Timestamp"] = f"{stamp:.3f}"
        signed["X-GPUFlex-Signature"] = node.key.private_key.sign(message).hex()
        code, detail = _status(coordinator.http.post("/v1/nodes/lease", headers=signed))
        assert code == 401 and "timestamp" in detail and "clock" in detail
    assert node.lease() is None  # a fresh one still works


def test_a_request_replayed_to_another_replica_is_refused(coordinator, tmp_path):
    node = coordinator.node("n1")
    signed = node.key.sign_request("POST", "/v1/nodes/lease", b"")
    assert coordinator.http.post("/v1/nodes/lease", headers=signed).status_code == 204
    with running_coordinator(
        str(coordinator.ctx.engine.url.render_as_string(hide_password=False)), tmp_path / "replica"
    ) as replica:
        code, detail = _status(replica.http.post("/v1/nodes/lease", headers=signed))
        assert code == 401 and "replayed" in detail
        fresh = node.key.sign_request("POST", "/v1/nodes/lease", b"")
        assert replica.http.post("/v1/nodes/lease", headers=fresh).status_code == 204
