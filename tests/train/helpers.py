"""Shared pieces of the train tests: a tiny spec, a synthetic corpus, a small llama directory and its
training spec, and a job run in threads."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from gpuflex.protocol.messages import RoundPublish, TaskConfig
from gpuflex.protocol.spec import ModelSpec, TrainingSpec
from gpuflex.testing import save_llama, write_corpus
from gpuflex.train.compression import get_compressor
from gpuflex.train.outer import GlobalReplica
from gpuflex.train.recipes import build_model
from gpuflex.train.task import run_task
from gpuflex.train.transport import LocalTransport, Transport

TINY_MODEL = ModelSpec(n_layer=1, n_head=2, n_embd=32, block_size=32)
POLL = 0.005  # seconds between polls: tests wait on each other often


def llama_dir(tmp_path_factory, **shape: Any) -> Path:
    """A small llama's ``save_pretrained`` directory, its tokenizer trained on a synthetic corpus."""
    texts = tmp_path_factory.mktemp("texts") / "t"
    write_corpus(texts, files=1, lines=200)
    return save_llama(tmp_path_factory.mktemp("model") / "m", [(texts / "part0.txt").read_text()], **shape)


def llama_training(model_dir: Path, **fields: Any) -> TrainingSpec:
    """A short hf-causal-lm job on ``model_dir``; ``fields`` replace or add to it."""
    base = {
        "recipe": "hf-causal-lm",
        "model": {"from": str(model_dir), "block_size": 32},
        "rounds": 2,
        "inner_steps": 4,
        "batch_size": 4,
        "lr": 1e-2,
        "eval_batches": 2,
    }
    return TrainingSpec.model_validate({**base, **fields})


def tiny_spec(**overrides: Any) -> TrainingSpec:
    fields: dict[str, Any] = {
        "rounds": 3,
        "inner_steps": 12,
        "batch_size": 8,
        "lr": 3e-3,
        "eval_batches": 2,
        "round_timeout_s": 30,
        "model": TINY_MODEL,
    }
    return TrainingSpec(**{**fields, **overrides})


def synthetic_corpus(n_bytes: int = 40_000, seed: int = 0) -> bytes:
    """Python-like lines from a small vocabulary: far from uniform bytes, so a model learns quickly."""
    rng = random.Random(seed)
    names = ["x", "y", "total", "items", "value", "self", "result", "count"]
    lines = []
    size = 0
    while size < n_bytes:
        a, b = rng.choice(names), rng.choice(names)
        line = rng.choice(
            [
                f"def f_{a}({a}, {b}):",
                f"    return {a} + {b}",
                f"    {a} = {b} * {rng.randint(0, 99)}",
                "",
                "# note",
            ]
        )
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines).encode()[:n_bytes]


def task_config(
    spec: TrainingSpec,
    dataset: str | None,
    role: str,
    index: int = 0,
    num_workers: int = 2,
    recipe_code: str | None = None,
) -> TaskConfig:
    return TaskConfig(
        job_id="job-1",
        task_id=f"{role}-{index}",
        role=role,
        worker_index=index,
        num_workers=num_workers,
        training=spec,
        dataset=dataset,
        recipe_code=recipe_code,
    )


class ThreadedJob:
    """Tasks of one job running in threads over one LocalTransport; ``stop`` ends them all."""

    def __init__(
        self,
        transport: LocalTransport,
        spec: TrainingSpec,
        dataset: str | None,
        num_workers: int = 2,
        recipe_code: str | None = None,
    ):
        self.recipe_code = recipe_code
        self.transport = transport
        self.spec = spec
        self.dataset = dataset
        self.num_workers = num_workers
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=8)

    def start(self, role: str, index: int = 0) -> Future[dict[str, Any]]:
        config = task_config(self.spec, self.dataset, role, index, self.num_workers, self.recipe_code)
        view = self.transport.for_task(config.task_id)
        return self.pool.submit(run_task, config, view, self.stopping.is_set, poll_interval_s=POLL)

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> ThreadedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Publisher:
    """Publishes real rounds without a running aggregator (round 0, then zero updates): a fault
    injector's tool for making rounds close exactly when a test wants them to."""

    def __init__(self, transport: Transport, spec: TrainingSpec):
        self.transport = transport
        self.spec = spec
        self.codec = get_compressor(spec.compression)
        self.replica = GlobalReplica(build_model(spec), spec)
        self.replica.round = 0
        state = transport.put_blob(self.replica.to_bytes())
        transport.publish_round(RoundPublish(round=0, state_hash=self.replica.state_hash(), checkpoint=state))

    def next_round(self) -> None:
        zeros = {n: torch.zeros_like(p) for n, p in self.replica.parameters().items()}
        blob = self.codec.compress(zeros)
        self.replica.apply(self.codec.decompress(blob))
        last = self.replica.round == self.spec.rounds
        self.transport.publish_round(
            RoundPublish(
                round=self.replica.round,
                state_hash=self.replica.state_hash(),
                update=self.transport.put_blob(blob),
                checkpoint=self.transport.put_blob(self.replica.to_bytes()) if last else None,
            )
        )


def audited_round(replica, data: list, segment: int):
    """Train ``replica``'s round 0, seal it, and have a ``Verifier`` (a model of its own, the same layout)
    audit ``segment`` of it: the round's result and the audit's verdict."""
    from gpuflex.protocol.messages import Contribution
    from gpuflex.train.checkpoint import sha256
    from gpuflex.train.verifier import Verifier

    start = replica.global_params()
    blob, result = replica.seal(replica.train_round(start, 0, lambda: False))
    contribution = Contribution(
        task_id="w0",
        node_id="n0",
        delta=sha256(blob),
        tokens=result.steps * replica.data.tokens_per_batch,
        steps=result.steps,
        train_loss=result.train_loss,
        commitment=result.commitment,
        audit_segment=segment,
    )
    verifier = Verifier(replica.spec, replica.recipe, data.__getitem__, len(data))
    (judged,) = verifier.screen(
        0, start, replica.global_.state_hash(), [(contribution, replica.decode(blob))]
    )
    return result, verifier.audit(0, judged, result.audit_state(segment))
