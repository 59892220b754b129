"""Training on a prepared dataset: each worker reads only its own shards and the validation split, and
verification draws the same batches from the same shards, so audits pass for the honest and convict a
cheater."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpuflex.data.assign import assign
from gpuflex.data.fetch import FetchedShards, LocalShards
from gpuflex.data.manifest import MANIFEST, read_manifest
from gpuflex.errors import BadRequest
from gpuflex.testing import prepare_bytes, train_bpe, write_corpus
from gpuflex.train.data import round_generator
from gpuflex.train.recipes import for_task, shards
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport

from .helpers import POLL, task_config, tiny_spec

TIMEOUT = 120


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """8 train shards of bytes and one validation shard."""
    root = tmp_path_factory.mktemp("prepared")
    write_corpus(root / "text")
    return prepare_bytes(root / "text", root / "prepared", shard_tokens=9_000, val_tokens=4_000)


def _config(spec, manifest_digest, role, index, workers):
    return task_config(spec, manifest_digest, role, index, workers).model_copy(update={"prepared": True})


def test_a_worker_opens_only_its_shards_and_an_auditor_draws_its_very_batches(prepared):
    manifest = read_manifest(prepared)
    blob = (prepared / MANIFEST).read_bytes()
    spec = tiny_spec()
    worker = LocalShards(prepared)
    _, data = for_task(_config(spec, manifest.digest, "worker", 1, 4), {manifest.digest: blob}.get, worker)
    assert worker.opened == ["validation-00000.bin"]  # nothing of the train split until a batch is drawn
    mine = [data.sample(round_generator(spec.seed, 1, r)) for r in range(3)]
    assert worker.opened == ["validation-00000.bin", "train-00002.bin", "train-00003.bin"]
    assert [s.shard for s in assign([s.tokens for s in manifest.train], 1, 4)] == [2, 3]
    auditor = LocalShards(prepared)
    recipe, _ = for_task(
        _config(spec, manifest.digest, "aggregator", 0, 4), {manifest.digest: blob}.get, auditor
    )
    data_for = shards(
        _config(spec, manifest.digest, "aggregator", 0, 4), recipe, {manifest.digest: blob}.get, auditor
    )
    theirs = [data_for(1).sample(round_generator(spec.seed, 1, r)) for r in range(3)]
    assert all(
        torch.equal(a, b) for m, t in zip(mine, theirs, strict=True) for a, b in zip(m, t, strict=True)
    )
    assert sorted(auditor.opened) == ["train-00002.bin", "train-00003.bin", "validation-00000.bin"]


def test_on_prepared_data_audits_pass_for_the_honest_and_convict_a_cheater(prepared):
    manifest = read_manifest(prepared)
    spec = tiny_spec(rounds=3, inner_steps=4, verification={"trace_every": 1})
    transport = LocalTransport(spec.rounds, live_workers=4, audit_rate=1.0)
    dataset = transport.put_blob((prepared / MANIFEST).read_bytes())
    for shard in manifest.train + manifest.validation:
        transport.put_blob((prepared / shard.file).read_bytes())
    stopping = threading.Event()
    readers = {}
    with ThreadPoolExecutor(max_workers=5) as pool:

        def start(role, index, adversary=None):
            config = _config(spec, dataset, role, index, 4).model_copy(update={"adversary": adversary})
            view = transport.for_task(config.task_id)
            readers[config.task_id] = FetchedShards(view.get_blob)
            return pool.submit(
                run_task, config, view, stopping.is_set, poll_interval_s=POLL, reader=readers[config.task_id]
            )

        honest = [start("worker", i) for i in range(3)]
        cheater = start("worker", 3, "fake-trace")
        try:
            assert start("aggregator", 0).result(timeout=TIMEOUT)["finished"]
            assert all(w.result(timeout=TIMEOUT)["finished"] for w in honest)
            assert cheater.result(timeout=TIMEOUT)["finished"] is False  # shut out, not finished
        finally:
            stopping.set()
    verdicts = transport.verdicts()
    guilty = [v for v in verdicts if v.guilty]
    assert [v.task_id for v in guilty] == ["worker-3"] and guilty[0].check == "audit"
    assert any(v.check == "audit" and not v.guilty for v in verdicts if v.task_id != "worker-3")
    for i in range(3):  # each honest worker read its two train shards and the validation split
        assert sorted(readers[f"worker-{i}"].opened) == [
            f"train-{2 * i:05d}.bin",
            f"train-{2 * i + 1:05d}.bin",
            "validation-00000.bin",
        ]
    assert len(readers["aggregator-0"].opened) == 9  # screening every worker: the whole dataset


def _federated(spec, digest, role, index=0):
    return task_config(spec, digest, role, index, 2).model_copy(update={"federated": "records"})


def _no_fetch(digest: str) -> bytes:
    raise AssertionError(f"a federated task fetched {digest}")


def test_a_federated_worker_trains_on_all_of_its_owners_shards_and_fetches_nothing(prepared):
    manifest = read_manifest(prepared)
    spec = tiny_spec()
    owner = LocalShards(prepared)
    _, data = for_task(_federated(spec, manifest.digest, "worker", 1), _no_fetch, owner)
    for r in range(40):  # enough draws to land in every one of the 8 train shards
        data.sample(round_generator(spec.seed, 1, r))
    assert sorted(owner.opened) == sorted(s.file for s in manifest.train + manifest.validation)
    _, none = for_task(_federated(spec, None, "aggregator"), _no_fetch, FetchedShards(_no_fetch))
    assert none.validation == []  # the aggregator holds no data


def test_a_federated_worker_checks_its_data_against_what_its_owner_announced(prepared):
    config = _federated(tiny_spec(), "0" * 64, "worker")
    with pytest.raises(BadRequest, match=r"'records' in .* changed since its node announced it"):
        for_task(config, _no_fetch, LocalShards(prepared))


def test_a_federated_worker_refuses_data_its_model_cannot_read(tmp_path):
    """Only the owner's node can tell: char-gpt reads bytes, and this owner prepared with a BPE tokenizer."""
    from gpuflex.data.prepare import prepare
    from gpuflex.data.sources import Source
    from gpuflex.data.tokenizer import load_tokenizer

    write_corpus(tmp_path / "text")
    docs = [p.read_text() for p in sorted((tmp_path / "text").iterdir())]
    train_bpe(docs, vocab_size=300).save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "prepared"
    prepare(Source([str(tmp_path / "text")]), load_tokenizer(str(tmp_path / "tokenizer.json")), out,
            shard_tokens=9_000, val_tokens=2_000)  # fmt: skip
    config = _federated(tiny_spec(), read_manifest(out).digest, "worker")
    with pytest.raises(BadRequest, match="recipe char-gpt is byte-level"):
        for_task(config, _no_fetch, LocalShards(out))


def test_a_federated_worker_on_a_node_without_the_data_fails_saying_so(prepared):
    manifest = read_manifest(prepared)
    with pytest.raises(BadRequest, match="this node holds no private dataset 'records'"):
        for_task(_federated(tiny_spec(), manifest.digest, "worker"), _no_fetch, FetchedShards(_no_fetch))
