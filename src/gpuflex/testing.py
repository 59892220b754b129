"""Tools the tests use to run real parts: the coordinator served on loopback, a node registered with
it, a clock to move, a small job to train, its blob byte counters, and the check of every invariant
straight from the database after a fault.

They ship with the library (as torchft's and hivemind's fault injectors do) so any test suite of
GPUFlex, or of a project built on it, can stand up a real network without mocking it.
"""

from __future__ import annotations

import itertools
import random
import secrets
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
import tokenizers
import uvicorn
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from gpuflex.auth.signing import NodeKey, sign_sealing_key
from gpuflex.client.node import NodeClient
from gpuflex.coordinator.db import (
    AccountBalance,
    Contribution,
    Job,
    JournalEntry,
    Lease,
    Round,
    Task,
    make_engine,
    make_sessionmaker,
)
from gpuflex.coordinator.services.ledger import entries
from gpuflex.coordinator.services.market import OPEN_JOB_STATES
from gpuflex.ledger import accounts
from gpuflex.ledger.journal import balances, verify_chain
from gpuflex.localnet import free_port
from gpuflex.privacy.envelope import public_bytes
from gpuflex.protocol import messages as m
from gpuflex.protocol.spec import JobSpec

T = TypeVar("T")


class Clock:
    """Real time plus an offset a test can advance (signed requests stay within the allowed skew); frozen,
    it stands still but for ``advance``, for a test whose margins a loaded machine's seconds would eat."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.frozen_at: float | None = None

    def __call__(self) -> float:
        return (time.time() if self.frozen_at is None else self.frozen_at) + self.offset

    def freeze(self) -> None:
        self.frozen_at = time.time()

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@contextmanager
def scratch_postgres_database(server_url: str, prefix: str = "gpuflex_test") -> Iterator[str]:
    """A new, empty PostgreSQL database on the server ``server_url`` names, dropped (its sessions
    ended) afterwards: each test or benchmark run starts clean and leaves nothing behind."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a loopback port, in a thread of this process; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the coordinator failed to start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def blob_bytes(url: str) -> dict[str, float]:
    """The blob bytes a coordinator carried (``in``, ``out``) and signed for (``signed_in``,
    ``signed_out``: moved by presigned URLs), from its ``/metrics``."""
    samples = {
        (s.name, s.labels.get("direction")): s.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        for s in family.samples
    }
    return {
        "in": samples.get(("gpuflex_blob_bytes_in_total", None), 0.0),
        "out": samples.get(("gpuflex_blob_bytes_out_total", None), 0.0),
        "signed_in": samples.get(("gpuflex_blob_bytes_signed_total", "in"), 0.0),
        "signed_out": samples.get(("gpuflex_blob_bytes_signed_total", "out"), 0.0),
    }


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, *, every_s: float = 0.3) -> T:
    """``condition()``'s first truthy value, polled; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def register_node(
    url: str,
    name: str,
    *,
    core_token: str | None = None,
    price: float = 0.1,
    tflops: float = 1.0,
    region: str = "local",
    gpu: m.GpuInfo | None = None,
    available_hours: float | None = None,
    key: NodeKey | None = None,
    private_data: Sequence[m.PrivateDataset] = (),
    consumers: Sequence[str] = (),
    sealing_key: X25519PrivateKey | None = None,
) -> NodeClient:
    """A node registered with the coordinator at ``url`` (core with ``core_token``), as its signed client:
    what an agent does before it asks for work, without the agent's benchmark; ``private_data`` and
    ``consumers``: what an owner announces (``provider start --private-data --allow-consumer``);
    ``sealing_key``: the X25519 key encrypted jobs' keys are sealed to, signed as an agent signs it."""
    client = NodeClient(url, key or NodeKey.generate())
    sealing = None if sealing_key is None else public_bytes(sealing_key).hex()
    hardware = m.HardwareProfile(
        cpu_model="test cpu",
        cpu_cores=2,
        ram_gb=4,
        device="cuda" if gpu else "cpu",
        gpus=[gpu] if gpu else [],
    )
    client.register(
        m.NodeRegister(
            name=name,
            public_key=client.key.public_key_hex,
            kind="core" if core_token else "community",
            core_token=core_token,
            price_per_hour=price,
            hardware=hardware,
            benchmark=m.BenchmarkResult(tflops_fp32=tflops, mem_bandwidth_gbps=10),
            region=region,
            available_hours=available_hours,
            private_data=list(private_data),
            consumers=list(consumers),
            sealing_key=sealing,
            sealing_key_signature=None if sealing is None else sign_sealing_key(client.key, sealing),
        )
    )
    return client


class CountingBlobs:
    """Blobs by hash, as the coordinator serves them, counting each fetch; ``bad`` answers that many
    fetches with junk (a download spoilt on the way)."""

    def __init__(self, blobs: dict[str, bytes], bad: int = 0):
        self.blobs = blobs
        self.bad = bad
        self.fetched: list[str] = []

    def fetch(self, digest: str) -> bytes:
        self.fetched.append(digest)
        if self.bad:
            self.bad -= 1
            return b"junk"
        return self.blobs[digest]


def write_corpus(directory: Path, *, files: int = 4, lines: int = 400) -> None:
    """A small text with structure a model learns in a few rounds (no download, no stdlib scan)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "train", "node", "round", "model", "lease", "epoch"]
    directory.mkdir(parents=True)
    for i in range(files):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(lines))
        (directory / f"part{i}.txt").write_text(text)


def prepare_bytes(text_dir: Path, out: Path, *, shard_tokens: int, val_tokens: int) -> Path:
    """``gpuflex data prepare TEXT_DIR --bytes``: a prepared dataset of ``write_corpus`` text, in ``out``."""
    from gpuflex.data.prepare import prepare
    from gpuflex.data.sources import Source
    from gpuflex.data.tokenizer import ByteTokenizer

    prepare(Source([str(text_dir)]), ByteTokenizer(), out, shard_tokens=shard_tokens, val_tokens=val_tokens)
    return out


def train_bpe(documents: list[str], vocab_size: int, eos: str = "<|endoftext|>") -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with an EOS token, trained on ``documents`` (nothing downloaded)."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def save_llama(
    directory: Path,
    documents: list[str],
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    vocab_size: int = 320,
    context: int = 128,
    seed: int = 0,
    init_std: float = 0.02,
    dtype: str = "float32",
) -> Path:
    """A llama-shaped model with a BPE tokenizer trained on ``documents``, saved as a Hugging Face model
    directory (``save_pretrained``: config.json, model.safetensors, tokenizer files): what a user brings
    to ``training.model.from``. Seeded; nothing downloaded. The vocabulary holds at least the 256 byte ids
    today's byte-level job data trains on. A larger ``init_std`` than transformers' 0.02 gives an untrained
    model peaked distributions and layers that matter to its hidden states, as a trained one has. ``dtype``
    (a torch dtype's name): what the weights are saved in, as a released bf16 model's are."""
    import torch
    import transformers

    transformers.logging.disable_progress_bar()
    eos = "<|endoftext|>"
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(documents, vocab_size, eos), eos_token=eos
    )
    config = transformers.LlamaConfig(
        vocab_size=max(len(tokenizer), 256),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def small_job(
    data_dir: Path, *, workers: int, rounds: int, inner_steps: int = 15, name: str = "small", **training
) -> JobSpec:
    """A job on ``write_corpus`` text with a one-layer model: a round takes a second or two on a CPU."""
    return JobSpec.model_validate(
        {
            "name": name,
            "resources": {"workers": workers},
            "training": {
                "rounds": rounds,
                "inner_steps": inner_steps,
                "batch_size": 16,
                "lr": 0.01,
                "round_timeout_s": 60,
                "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
                **training,
            },
            "data": {"source": str(data_dir), "extensions": [".txt"], "max_bytes": 100_000},
            "budget": 1.0,
            "max_price_per_hour": 0.5,
        }
    )


def check_invariants(database_url: str, *, ledger_public_key: str | None = None) -> list[str]:
    """Every invariant of docs/architecture.md that the database can show; each problem as a sentence.

    Read straight from the tables, not through the API, so a bug in a view can't hide a bug in a write.
    An empty list means the network is sound: run it after every fault a test injects. Give the
    coordinator's ``ledger_public_key`` to check the journal's signatures too.
    """
    engine = make_engine(database_url)
    # one snapshot for every table: under PostgreSQL's default isolation each statement sees its own, and
    # a round published between reading its job and reading its rounds looked like a broken invariant
    postgres = engine.dialect.name == "postgresql"
    reads = engine.execution_options(isolation_level="REPEATABLE READ") if postgres else engine
    try:
        with make_sessionmaker(reads)() as session:
            return [
                *_lease_problems(session),
                *_round_problems(session),
                *_money_problems(session, ledger_public_key),
            ]
    finally:
        engine.dispose()


def _lease_problems(session) -> list[str]:

    problems = []
    by_task, active_by_node = defaultdict(list), defaultdict(list)
    for lease in session.scalars(select(Lease).order_by(Lease.epoch)):
        by_task[lease.task_id].append(lease)
        if lease.state == "active":
            active_by_node[lease.node_id].append(lease.id)
    for node, held in active_by_node.items():
        if len(held) > 1:
            problems.append(f"node {node} holds {len(held)} live leases: {held}")
    ended = {
        job_id for job_id, state in session.execute(select(Job.id, Job.state)) if state not in OPEN_JOB_STATES
    }
    for task in session.scalars(select(Task)):
        leases = by_task[task.id]
        # a task that never ran is `unplaced` once its job ended (never `completed`), and only such a task
        never_ran = task.job_id in ended and not leases
        if task.state == "unplaced" and not never_ran:
            why = "it held a lease" if leases else "its job is still open"
            problems.append(f"task {task.id} is unplaced, but {why}")
        elif never_ran and task.state != "unplaced":
            problems.append(f"task {task.id} never ran, yet its job ended with it {task.state}")
        live = [lease for lease in leases if lease.state == "active"]
        if len(live) > 1:
            problems.append(f"task {task.id} has {len(live)} live leases")
        if len({lease.epoch for lease in leases}) != len(leases):
            problems.append(f"task {task.id} was leased twice under one epoch")
        for before, after in itertools.pairwise(leases):
            if before.ended_at is None or after.granted_at < before.ended_at:
                problems.append(
                    f"task {task.id}: epoch {after.epoch} was granted while epoch {before.epoch} lived"
                )
        if live and (task.state, task.epoch) != ("leased", live[0].epoch):
            problems.append(
                f"task {task.id} is {task.state} at epoch {task.epoch} under live epoch {live[0].epoch}"
            )
        if leases and task.epoch != leases[-1].epoch:
            problems.append(
                f"task {task.id} is at epoch {task.epoch}, its newest lease at {leases[-1].epoch}"
            )
    return problems


def _round_problems(session) -> list[str]:

    problems = []
    for job in session.scalars(select(Job).where(Job.kind == "training")):  # deployments have no rounds
        published = list(
            session.scalars(select(Round.round).where(Round.job_id == job.id).order_by(Round.round))
        )
        if published != list(range(job.round + 1)):
            problems.append(f"job {job.id} at round {job.round} has published rounds {published}")
        if job.state == "completed" and job.round != JobSpec.model_validate(job.spec).training.rounds:
            problems.append(f"job {job.id} completed at round {job.round}")
        for row in session.scalars(select(Round).where(Round.job_id == job.id, Round.round > 0)):
            there = session.scalar(
                select(func.count(Contribution.id)).where(
                    Contribution.job_id == job.id, Contribution.round == row.round - 1
                )
            )
            if row.contributions > there:
                problems.append(
                    f"job {job.id} round {row.round} used {row.contributions} of {there} contributions"
                )
    for c in session.scalars(select(Contribution)):
        lease = session.get(Lease, c.lease_id)
        if lease.task_id != c.task_id or lease.node_id != c.node_id:
            problems.append(f"contribution {c.id} came through another task's lease")
        if c.created_at < lease.granted_at:
            problems.append(f"contribution {c.id} predates its lease")
    return problems


def _money_problems(session, ledger_public_key: str | None) -> list[str]:

    journal = entries(session)
    problems = []
    report = verify_chain(journal, public_key=ledger_public_key)
    if not report.ok:
        problems.append(f"the journal does not verify: {report.problem}")
    replayed = {a: n for a, n in balances(journal).items() if n}
    kept = {row.account: row.balance for row in session.scalars(select(AccountBalance)) if row.balance}
    if kept != replayed:
        problems.append(f"kept balances {kept} differ from the journal's {replayed}")
    if sum(replayed.values()) != 0:
        problems.append(f"money is not conserved: balances sum to {sum(replayed.values())}")
    settlements = Counter(
        memo.split()[1]
        for memo in session.scalars(select(JournalEntry.memo).where(JournalEntry.kind == "settlement"))
    )
    for job in session.scalars(select(Job)):
        times = settlements.get(job.id, 0)
        ended = job.state not in OPEN_JOB_STATES
        if times != int(ended):
            problems.append(f"job {job.id} ({job.state}) was settled {times} times")
        if ended and replayed.get(accounts.escrow(job.id), 0):
            problems.append(f"job {job.id} ended with {replayed[accounts.escrow(job.id)]} left in escrow")
    return problems
