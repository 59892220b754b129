"""``privacy.encrypt``'s keys through the real API: a node gets the job's data key only while it holds a
live lease at its current epoch, sealed by the consumer's CLI to the key the node signed; the job's log
says a node waits for it; bad input is one line."""

import json
import secrets
import subprocess

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gpuflex.agent.daemon import Agent, AgentConfig, RunningTask
from gpuflex.agent.runner import DATA_KEY
from gpuflex.agent.sandbox import TaskProcess
from gpuflex.auth.sealing import load_or_create
from gpuflex.cli.data import upload_prepared
from gpuflex.cli.inputs import upload_model
from gpuflex.cli.keys import consumer_key, data_key, key_path, new_job_key, seal_requests
from gpuflex.coordinator.app import reap_once
from gpuflex.data.cache import ShardCache
from gpuflex.data.fetch import FetchedShards
from gpuflex.data.manifest import numpy_dtype, parse_manifest, read_manifest
from gpuflex.data.tokenizer import ByteTokenizer
from gpuflex.errors import BadRequest, Conflict, Forbidden, Unauthorized
from gpuflex.privacy.envelope import (
    JOB_BLOB,
    encrypt_blob,
    new_data_key,
    public_bytes,
    seal_for_consumer,
    seal_key,
    unseal_key,
)
from gpuflex.protocol import messages as m
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import DataSpec, JobSpec, TrainingSpec
from gpuflex.testing import prepare_bytes, register_node, save_llama, write_corpus
from gpuflex.train.pretrained import model_directory, same_model
from gpuflex.train.recipes.prepared import prepared_data
from gpuflex.train.transport import SealedTransport, as_stored, fetch_verified

from .conftest import CORE_TOKEN


def _spec(encrypt: bool = True) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "secret",
            "resources": {"workers": 1},
            "data": {"source": "./text"},
            "privacy": {"encrypt": encrypt},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
        }
    )


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the consumer's sealing key lives under it
    load_or_create(key_path())  # as the first encrypted submit makes it


def _submit(lab, key: bytes) -> m.JobInfo:
    dataset = lab.upload(encrypt_blob(key, b"the corpus", JOB_BLOB))
    sealed = seal_for_consumer(key, public_bytes(consumer_key())).hex()
    return lab.submit(_spec(), dataset=dataset, sealed_key=sealed)


def test_a_node_gets_the_key_only_for_its_live_lease_and_only_it_can_open_it(coordinator, home):
    sealing = {name: X25519PrivateKey.generate() for name in ("core", "a", "b")}
    core = coordinator.node("core", core=True, sealing_key=sealing["core"])
    a = coordinator.node("a", sealing_key=sealing["a"])
    b = coordinator.node("b", price=0.2, sealing_key=sealing["b"])
    lab = coordinator.consumer("lab", deposit=5)
    key = new_data_key()
    job = _submit(lab, key)
    aggregator, worker = core.lease(), a.lease()
    assert worker.task.encrypted and aggregator.task.encrypted

    for _ in range(2):  # the consumer serves no key yet: the node is told why, the log hears it once
        waiting = a.lease_key(worker.lease_id, worker.epoch)
        assert waiting.sealed_key is None and f"gpuflex job keys {job.id}" in waiting.waiting
    log = [e.message for e in lab.logs(job.id)]
    assert sum("worker 0 on" in x and "waits for the consumer's data key" in x for x in log) == 1, log
    assert lab.job(job.id).key_waits == ["aggregator 0 on core", "worker 0 on a"]  # `job show` lists them

    said: list[str] = []
    assert seal_requests(lab, job.id, consumer_key(), said.append)  # the job still runs
    assert len(said) == 2 and all(x.startswith("data key sealed to ") for x in said), said
    assert lab.job_keys(job.id).requests == [] and lab.job(job.id).key_waits == []  # both have theirs
    sealed = bytes.fromhex(a.lease_key(worker.lease_id, worker.epoch).sealed_key)
    assert unseal_key(sealed, sealing["a"], job.id) == key
    with pytest.raises(BadRequest, match="sealed to another key"):  # another node's key does not open it
        unseal_key(sealed, sealing["core"], job.id)
    with pytest.raises(BadRequest, match="for a job other than"):
        unseal_key(sealed, sealing["a"], "j-other")

    with pytest.raises(Forbidden):  # another node asking for this lease's key
        b.lease_key(worker.lease_id, worker.epoch)
    with pytest.raises(Conflict, match="no longer live"):  # a stale epoch
        a.lease_key(worker.lease_id, worker.epoch + 1)
    a.report(worker.lease_id, m.LeaseReport(epoch=worker.epoch, outcome="failed", detail="gone"))
    with pytest.raises(Conflict, match="no longer live"):  # no lease any more: no key, though one was sealed
        a.lease_key(worker.lease_id, worker.epoch)
    with pytest.raises(Conflict, match="no longer live"):  # nor can the consumer seal to it
        lab.grant_key(job.id, m.KeyGrant(lease_id=worker.lease_id, epoch=worker.epoch, sealed_key="00"))

    reap_once(coordinator.ctx)  # the worker's task placed again: its new lease asks for its own key
    holder, again = next((n, g) for n in (a, b) if (g := n.lease()) is not None)
    assert again.task_id == worker.task_id and again.epoch == worker.epoch + 1
    assert [r.lease_id for r in lab.job_keys(job.id).requests] == [again.lease_id]
    assert holder.lease_key(again.lease_id, again.epoch).sealed_key is None


def test_a_task_left_waiting_past_key_wait_s_stops_the_job_and_the_budget_comes_back(coordinator, home):
    coordinator.node("core", core=True, sealing_key=X25519PrivateKey.generate())
    a = coordinator.node("a", sealing_key=X25519PrivateKey.generate())
    lab = coordinator.consumer("lab", deposit=5)
    job = _submit(lab, new_data_key())  # privacy.key_wait_s: 900 by default
    worker = a.lease()
    assert "for at most 900s, and then the job stops" in a.lease_key(worker.lease_id, worker.epoch).waiting

    coordinator.clock.advance(850)  # liveness is not judged: the lease stays live, as a beating node keeps it
    reap_once(coordinator.ctx, judge_liveness=False)
    assert lab.job(job.id).state in ("scheduled", "running")
    coordinator.clock.advance(100)
    reap_once(coordinator.ctx, judge_liveness=False)
    stopped = lab.job(job.id)
    assert stopped.state == "failed", stopped
    assert "waited 950s for its data key (privacy.key_wait_s 900s)" in stopped.reason, stopped.reason
    assert f"gpuflex job keys {job.id}" in stopped.reason
    keys = lab.job_keys(job.id)
    assert not keys.open and keys.requests == []  # its lease ended with the job: nobody asks for a key
    waited = 0.1 * 950 / 3600  # the worker's 950 s at its 0.1/h: the wait is paid, the rest of the budget not
    assert lab.balance().balance == pytest.approx(5.0 - waited, abs=1e-4)


def test_a_sealing_key_the_node_did_not_sign_is_refused_at_register_and_never_sealed_to(coordinator, home):
    honest = coordinator.node("honest")
    forged = m.NodeRegister(  # a key the node never signed, as a coordinator would slip in
        name="honest",
        public_key=honest.key.public_key_hex,
        hardware=m.HardwareProfile(cpu_model="cpu", cpu_cores=1, ram_gb=1, device="cpu", gpus=[]),
        benchmark=m.BenchmarkResult(tflops_fp32=1, mem_bandwidth_gbps=1),
        price_per_hour=0.1,
        sealing_key=public_bytes(X25519PrivateKey.generate()).hex(),
        sealing_key_signature="00" * 64,
    )
    with pytest.raises(Unauthorized, match="did not sign this sealing key"):
        honest.register(forged)

    coordinator.node("core", core=True, sealing_key=X25519PrivateKey.generate())
    plain = coordinator.node("plain")  # an agent that registered no sealing key
    lab = coordinator.consumer("lab", deposit=5)
    job = _submit(lab, new_data_key())
    grant = plain.lease()
    said: list[str] = []
    seal_requests(lab, job.id, consumer_key(), said.append)
    assert any(x.startswith("not sealed to worker 0 on plain") and "no sealing key" in x for x in said), said
    assert plain.lease_key(grant.lease_id, grant.epoch).sealed_key is None


def test_bad_input_is_one_line(coordinator, home):
    lab = coordinator.consumer("lab", deposit=5)
    dataset = lab.upload(b"plain")
    with pytest.raises(BadRequest, match=r"privacy\.encrypt: submit the job's data key sealed to your own"):
        lab.submit(_spec(), dataset=dataset)
    with pytest.raises(BadRequest, match=r"and only with privacy\.encrypt"):
        lab.submit(_spec(encrypt=False), dataset=dataset, sealed_key="ab" * 40)
    plain = lab.submit(_spec(encrypt=False), dataset=dataset)
    with pytest.raises(BadRequest, match="is not encrypted"):
        lab.job_keys(plain.id)
    assert lab.job(plain.id).key_waits is None
    assert lab.balance().balance == pytest.approx(4.0)  # only the plain job's budget moved

    job = _submit(lab, new_data_key())
    key_path().unlink()  # another machine, or a lost key
    with pytest.raises(BadRequest, match=r"no sealing key at .*sealing\.key: an encrypted job's key opens"):
        consumer_key()
    load_or_create(key_path())  # another key than the one the job's key was sealed to
    with pytest.raises(BadRequest, match=r"does not open with .*sealing\.key .*sealed to another key"):
        data_key(lab.job_keys(job.id), consumer_key())


def test_the_agent_hands_its_task_the_key_it_opens_and_fails_a_task_whose_key_does_not_open(
    coordinator, home, tmp_path
):
    config = AgentConfig(coordinator.url, "core", tmp_path / "agent", price_per_hour=0.1)
    agent = Agent(config)  # not started: the test drives its watch of a task by hand
    register_node(
        coordinator.url, "core", core_token=CORE_TOKEN, key=agent.key, sealing_key=agent.sealing_key
    )
    coordinator.node("w", sealing_key=X25519PrivateKey.generate())
    lab = coordinator.consumer("lab", deposit=5)
    key = new_data_key()
    job = _submit(lab, key)

    def running(grant: m.LeaseGrant) -> RunningTask:  # a stand-in for the task's process: it only waits
        workdir = tmp_path / grant.lease_id
        workdir.mkdir()
        popen = subprocess.Popen(["sleep", "60"], start_new_session=True)
        return RunningTask(grant, TaskProcess(popen, workdir / "task.log"), workdir, keyed=False)

    agent.task = task = running(agent.client.lease())
    agent._watch_task()  # no key served yet: the task keeps waiting
    assert not task.keyed and not (task.workdir / DATA_KEY).exists()
    seal_requests(lab, job.id, consumer_key(), lambda _: None)
    task.next_key_ask = 0.0
    agent._watch_task()
    assert task.keyed and (task.workdir / DATA_KEY).read_bytes() == key
    task.process.terminate(grace_s=1)
    agent.client.report(task.grant.lease_id, m.LeaseReport(epoch=task.grant.epoch, outcome="released"))

    reap_once(coordinator.ctx)
    agent.task = again = running(agent.client.lease())  # the aggregator, leased again
    wrong = seal_key(key, public_bytes(agent.sealing_key), "j-another-job")  # a key sealed for another job
    lab.grant_key(
        job.id, m.KeyGrant(lease_id=again.grant.lease_id, epoch=again.grant.epoch, sealed_key=wrong.hex())
    )
    agent._watch_task()
    assert agent.task is None and again.process.poll() is not None  # stopped, and reported
    log = [e.message for e in lab.logs(job.id)]
    assert any(
        "the job's data key cannot be unsealed here: sealed job key fails its check" in x for x in log
    ), log
    agent.client.close()


def test_an_encrypted_prepared_dataset_is_stored_as_ciphertext_and_a_leased_task_reads_its_tokens(
    coordinator, home, tmp_path
):
    canary = f"CANARY-{secrets.token_hex(8)}"
    write_corpus(tmp_path / "text")
    (tmp_path / "text" / "part0.txt").write_text((canary + " alpha.\n") * 200)
    prepared = prepare_bytes(tmp_path / "text", tmp_path / "prepared", shard_tokens=18_000, val_tokens=4_000)
    plain = read_manifest(prepared)
    as_tokens = ByteTokenizer().encode([canary])[:-1].astype(numpy_dtype(plain.dtype)).tobytes()
    assert as_tokens in (prepared / plain.train[0].file).read_bytes()  # the canary is in the shards
    sealing = X25519PrivateKey.generate()
    core = coordinator.node("core", core=True, sealing_key=X25519PrivateKey.generate())
    node = coordinator.node("a", sealing_key=sealing)
    lab = coordinator.consumer("lab", deposit=5)
    spec = _spec().model_copy(update={"data": DataSpec(prepared=str(prepared))})

    job_key = new_job_key()
    uploaded = upload_prepared(lab, spec, prepared, job_key.seal)
    assert uploaded.sent == uploaded.shards == len(plain.train) + len(plain.validation)
    job = lab.submit(spec, dataset=uploaded.manifest, sealed_key=job_key.sealed)
    core.lease()
    grant = node.lease()
    seal_requests(lab, job.id, consumer_key(), lambda _: None)
    key = unseal_key(bytes.fromhex(node.lease_key(grant.lease_id, grant.epoch).sealed_key), sealing, job.id)

    task = coordinator.task(grant)  # the task's own view: its transport opens what it fetches
    transport = SealedTransport(task, key)
    reader = FetchedShards(task.get_blob, ShardCache(tmp_path / "cache", 1 << 30), transport.unseal)
    stored = parse_manifest(fetch_verified(transport, grant.task.dataset), "the job's manifest")
    for mine, theirs in zip(plain.train + plain.validation, stored.train + stored.validation, strict=True):
        assert theirs.sha256 != mine.sha256  # stored by its ciphertext's hash
        expected = np.fromfile(prepared / mine.file, dtype=numpy_dtype(plain.dtype))
        assert np.array_equal(reader.open(theirs, stored.dtype), expected)
    assert prepared_data(grant.task, lambda d: fetch_verified(transport, d), reader)(0).tokens_per_batch
    task.close()

    blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert len(blobs) > uploaded.shards and cached  # the shards, the manifest; the node's cache
    for path in blobs + cached:  # the store and the node's disk hold ciphertext only
        data = path.read_bytes()
        assert canary.encode() not in data and as_tokens not in data, path


def test_an_encrypted_model_directory_is_stored_and_cached_as_ciphertext_and_opens_only_in_the_task(
    coordinator, home, tmp_path
):
    canary = f"CANARY-{secrets.token_hex(8)}"
    model_dir = save_llama(tmp_path / "model", ["alpha beta gamma delta. " * 50], hidden=64)
    for name in ("config.json", "tokenizer_config.json"):  # the canary in the config and the tokenizer
        path = model_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "note": canary}))
    core = coordinator.node("core", core=True, sealing_key=X25519PrivateKey.generate())
    sealing = X25519PrivateKey.generate()
    node = coordinator.node("a", sealing_key=sealing)
    lab = coordinator.consumer("lab", deposit=5)
    training = {"recipe": "hf-causal-lm", "model": {"from": str(model_dir)}, "lora": {"r": 4}}
    spec = _spec().model_copy(update={"training": TrainingSpec.model_validate(training)})

    job_key = new_job_key()
    spec = upload_model(lab, spec, job_key)
    uploaded, size = spec.training.model.uploaded, spec.training.model.size
    assert uploaded.part_bytes < coordinator.ctx.settings.max_blob_bytes  # a sealed part fits the limit
    assert 0 < size.trainable < size.parameters  # counted on the consumer's machine: the job's declared size
    job = lab.submit(spec, dataset=lab.upload(job_key.seal(b"the corpus")), sealed_key=job_key.sealed)
    assert lab.job(job.id).spec.training.model.uploaded == uploaded
    deployment = DeploymentSpec.model_validate({"name": "d", "model": {"job": job.id}, "budget": 0.1})
    with pytest.raises(BadRequest, match=r"is encrypted \(privacy\.encrypt\): its checkpoint and model"):
        lab.deploy(deployment)  # no replica holds the key: refused before money moves
    core.lease()
    grant = node.lease()
    seal_requests(lab, job.id, consumer_key(), lambda _: None)
    key = unseal_key(bytes.fromhex(node.lease_key(grant.lease_id, grant.epoch).sealed_key), sealing, job.id)

    task = coordinator.task(grant)
    stored, unseal = as_stored(SealedTransport(task, key))
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    with model_directory(grant.task.training, stored, cache, unseal) as opened:
        files = sorted(p.name for p in model_dir.iterdir())
        assert sorted(p.name for p in opened.iterdir()) == files
        for name in files:  # the task's own plaintext copy, not a link into the node's cache
            assert not (opened / name).is_symlink()
            assert (opened / name).read_bytes() == (model_dir / name).read_bytes(), name
    with model_directory(grant.task.training, stored, None, unseal) as opened:  # no cache: in memory
        assert (opened / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    task.close()

    at_rest = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    for path in at_rest + cached:
        assert canary.encode() not in path.read_bytes(), path
    blobs = {p.name for p in cached if len(p.name) == 64}  # every part and the manifest, by ciphertext hash
    assert len(blobs) > 3 and uploaded.manifest in blobs and blobs <= {p.name for p in at_rest}
    assert canary not in lab.job(job.id).model_dump_json()  # nor the spec the coordinator keeps

    assert same_model(model_dir, uploaded, key)  # `job fetch --format hf`: the base checked by the key
    assert not same_model(model_dir, uploaded, new_data_key()) and not same_model(model_dir, uploaded)
    (model_dir / "tokenizer_config.json").write_text("{}")
    assert not same_model(model_dir, uploaded, key)
