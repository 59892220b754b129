"""Fine-tuning a model directory with DiLoCo: loss against one process, bytes with and without LoRA, data.

    python bench/finetune.py              # the reported mode (see bench/README.md)
    python bench/finetune.py --quick      # smaller runs: under 6 minutes on 2 cores
    python bench/finetune.py --data DIR   # the UTF-8 text files under DIR instead of the stdlib's source

What a user of issue 29 does, at a small scale: a llama-shaped model of ~1.3M parameters saved with
``save_pretrained``, with a byte-level BPE tokenizer trained by ``tokenizers`` on the benchmark's own text
(``gpuflex.testing.save_llama``); the text prepared by the real pipeline (``gpuflex.data.prepare``, as
``gpuflex data prepare --tokenizer MODEL_DIR`` runs it) into several train shards per worker; then
``hf-causal-lm`` jobs with ``model.from`` on 4 workers (``train.local.run_local`` with ``prepared=``: an
aggregator and the workers as processes, every worker's traffic metered on its link), int8 compression
and diloco_vs_ddp's outer step (lr 1.5, no momentum). Audits are off: an audited worker uploads its
training state, which is verification's cost (``bench/verification.py``), not the exchange's.

The documents (the text cut at blank lines) are shuffled, seeded, before they are prepared: the validation
split is the stream's tail, and unshuffled it would be the last files' text alone. Then, on the prepared
shards:

0. ``base``: one process trains the saved (random) model on the job's token budget (below) with the
   spec's default lr and its own batch draws, and saves it as a model directory: the model a user
   brings to fine-tune, one that has learnt something.
1. ``full``: every weight of the base fine-tunes (lr 1e-3).
2. ``lora``: LoRA adapters (r 8 on q_proj and v_proj) fine-tune the base (lr 1e-2).

Each fine-tune runs twice: as the DiLoCo job, and as one process training the same model on the same
token budget (workers x rounds x inner steps x batch): as many steps as a worker takes, each on
``workers`` times its batch, with the same AdamW, lr schedule, clipping and precision (``worker.step``),
on every train shard: the arithmetic of diloco_vs_ddp's DDP baseline, without the all-reduce. It runs
on one torch thread, as each worker does.

Fields of the JSON line (the last of stdout; ``bench/results/finetune[-quick].json`` holds the same):

- ``full_loss_gap``, ``lora_loss_gap``: (DiLoCo's final validation loss - the one process's) / the one
  process's, on the same fixed validation batches;
- ``full_bytes_per_round``, ``lora_bytes_per_round``: what a worker's link carried over the job, both
  ways, blobs and messages, over the rounds (the mean over workers; nobody downloads the last round's
  update, so it is a little under one contribution up and one update down); ``lora_bytes_ratio``: LoRA's
  over the full fine-tune's (target <= 0.02);
- ``worker_download_share``: the bytes of the shards opened by the worker that read most (train and
  validation) over all the shards' bytes (target <= 1/workers + ``validation_share`` + 0.05);
  ``shards_read``: each worker's count of shards, both jobs' workers;
- ``prepare_tokens_per_s``, ``tokenizer_direct_tokens_per_s``, ``prepare_ratio``: ``bench/prepare.py``'s
  measurement on the same text and tokenizer (target >= 0.8);
- ``targets``: each target's verdict; then the settings, parameters, tokens, losses and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diloco_vs_ddp import CONFIGS
from prepare import corpus_documents, measure

from gpuflex.data.fetch import LocalShards
from gpuflex.data.manifest import read_manifest
from gpuflex.data.prepare import prepare
from gpuflex.data.sources import Source
from gpuflex.data.tokenizer import load_tokenizer
from gpuflex.protocol.spec import TrainingSpec
from gpuflex.testing import save_llama
from gpuflex.train.data import round_generator
from gpuflex.train.local import LocalResult, run_local
from gpuflex.train.precision import InnerStep
from gpuflex.train.recipes import build_model, evaluate, get_recipe
from gpuflex.train.recipes.prepared import task_data
from gpuflex.train.schedule import set_lr
from gpuflex.train.trainable import trainable
from gpuflex.train.worker import inner_optimizer, step

# -- settings ---------------------------------------------------------------------------------------
WORKERS = 4
VOCAB = 2048  # the BPE's vocabulary, and the model's embeddings
SHARDS_PER_WORKER = 8  # train shards each worker gets: the download share is then a share of many files
INT8 = next(c for c in CONFIGS if c.name == "diloco-adamw-int8")  # diloco_vs_ddp's compression, outer step
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
BASE_LR = 3e-3  # the base's training: the job spec's default
FULL_LR = 1e-3  # a fine-tune of every weight: a third of that, so a fresh AdamW does not undo the base
LORA_LR = 1e-2  # the adapters start at zero and are few: LoRA's customary lr, 10x a full fine-tune's
POLL_S = 0.2  # how often tasks poll for a round (the runtime's default)
TARGETS = {"lora_bytes_ratio": 0.02, "prepare_ratio": 0.8, "download_slack": 0.05}
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Mode:
    """How big the runs are."""

    hidden: int
    layers: int
    heads: int
    block_size: int
    batch_size: int  # sequences per inner step of a worker
    rounds: int
    inner_steps: int
    eval_batches: int
    text_bytes: int  # at most this much of the text
    prepare_runs: int  # bench/prepare.py's alternating runs of each


QUICK = Mode(128, 3, 4, 128, 8, 4, 20, 8, 4_000_000, 3)
DEFAULT = Mode(128, 3, 4, 128, 8, 8, 40, 16, 64_000_000, 5)


@dataclass
class Run:
    """One training run: DiLoCo's job, or the one process's."""

    name: str
    val_loss: float
    tokens: int
    wall_s: float  # DiLoCo: round 0 published -> last round published; one process: its training loop
    trainable_parameters: int
    val_losses: list[float | None]  # DiLoCo: every round's; one process: the final one
    bytes_per_worker: float = 0.0  # sent + received over the job, the mean over workers
    shards: list[list[str]] | None = None  # each worker's opened shard files


def spec_for(mode: Mode, model_dir: Path, seed: int, lr: float, lora: dict | None = None) -> TrainingSpec:
    return TrainingSpec.model_validate(
        {
            "recipe": "hf-causal-lm",
            "model": {"from": str(model_dir), "block_size": mode.block_size},
            "lora": lora,
            "seed": seed,
            "lr": lr,
            "rounds": mode.rounds,
            "inner_steps": mode.inner_steps,
            "batch_size": mode.batch_size,
            "eval_batches": mode.eval_batches,
            "compression": INT8.compression.model_dump(),
            "outer_lr": INT8.outer_lr,
            "outer_momentum": INT8.outer_momentum,
            "round_timeout_s": 3600,  # every worker is waited for
            "verification": {"audit_rate": 0},
        }
    )


def run_diloco(name: str, spec: TrainingSpec, prepared: Path) -> Run:
    result = run_local(spec, None, WORKERS, poll_interval_s=POLL_S, timeout_s=3 * 3600, prepared=prepared)
    rounds = result.rounds
    assert result.spec is not None and result.spec.model.size is not None, "run_local sizes model.from"
    return Run(
        name=name,
        val_loss=_final(result),
        tokens=rounds[-1].tokens,
        wall_s=rounds[-1].seconds - rounds[0].seconds,
        trainable_parameters=result.spec.model.size.trainable,
        val_losses=[r.val_loss for r in rounds],
        bytes_per_worker=statistics.mean(w.link.bytes_total for w in result.workers),
        shards=[w.shards for w in result.workers],
    )


def _final(result: LocalResult) -> float:
    loss = result.rounds[-1].val_loss
    assert loss is not None, "the aggregator evaluates every round on the validation split"
    return loss


def run_single(name: str, spec: TrainingSpec, prepared: Path, save_to: Path | None = None) -> Run:
    """One process on the job's token budget: a worker's steps, each on WORKERS times its batch, drawn
    from every train shard; evaluated on the job's validation batches. ``save_to``: write the trained
    model there as a model directory, with the tokenizer of the one it came from."""
    assert spec.model.from_ is not None
    model_dir = Path(spec.model.from_)
    recipe = get_recipe(spec.recipe).from_directory(model_dir)
    model = build_model(spec, recipe)
    manifest, reader = read_manifest(prepared), LocalShards(prepared)
    wide = spec.model_copy(update={"batch_size": spec.batch_size * WORKERS})
    data = task_data(manifest, reader, wide, 0, 1)
    validation = task_data(manifest, reader, spec, 0, 1).validation  # the aggregator's batches
    optimizer, inner = inner_optimizer(model, spec), InnerStep.for_spec(spec, torch.device("cpu"))
    generator = round_generator(spec.seed, 0, 0)
    steps = spec.rounds * spec.inner_steps
    model.train()
    began = time.monotonic()
    for k in range(steps):
        set_lr(optimizer, spec, k / steps)  # a worker's schedule: the job's progress
        step(recipe, model, model, optimizer, data.sample(generator), inner=inner)
    wall = time.monotonic() - began
    val = evaluate(recipe, model, validation)
    assert val is not None
    if save_to is not None:
        model.save_pretrained(save_to)
        for tokenizer_file in model_dir.glob("*token*"):
            shutil.copy(tokenizer_file, save_to)
    return Run(
        name=name,
        val_loss=val,
        tokens=steps * data.tokens_per_batch,
        wall_s=wall,
        trainable_parameters=sum(p.numel() for p in trainable(model).values()),
        val_losses=[val],
    )


def prepare_dataset(documents: list[str], model_dir: Path, out: Path, tokens: int) -> Path:
    """The documents as JSON Lines, prepared with the model directory's tokenizer into SHARDS_PER_WORKER
    train shards per worker (and the default validation share)."""
    jsonl = out.parent / "documents.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    shard_tokens = -(-tokens // (WORKERS * SHARDS_PER_WORKER))
    prepare(Source([str(jsonl)]), load_tokenizer(str(model_dir)), out, shard_tokens=shard_tokens)
    return out


def download_share(prepared: Path, opened: list[list[str]]) -> dict[str, Any]:
    """What each worker read of the dataset, in bytes, over all of it; and the target for the largest."""
    manifest = read_manifest(prepared)
    size = {s.file: (prepared / s.file).stat().st_size for s in [*manifest.train, *manifest.validation]}
    total = sum(size.values())
    validation = sum(size[s.file] for s in manifest.validation) / total
    shares = [sum(size[f] for f in files) / total for files in opened]
    return {
        "worker_download_share": max(shares),
        "worker_download_shares": shares,
        "validation_share": validation,
        "worker_download_share_target": 1 / WORKERS + validation + TARGETS["download_slack"],
        "train_shards": len(manifest.train),
        "validation_shards": len(manifest.validation),
        "shards_read": [len(files) for files in opened],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs: under 6 minutes on 2 cores")
    parser.add_argument("--data", default="stdlib", help="a directory of text files (default: the stdlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mode = QUICK if args.quick else DEFAULT
    # one thread, as each worker has: two threads beside other load run 4-5x slower than one (measured)
    torch.set_num_threads(1)
    began, load_before = time.monotonic(), os.getloadavg()
    documents = corpus_documents(args.data, mode.text_bytes)
    random.Random(args.seed).shuffle(documents)  # the validation split (the tail) samples the whole text
    print(f"{len(documents):,} documents from {args.data}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpuflex-finetune-") as tmp:
        root = Path(tmp)
        model_dir = save_llama(
            root / "model",
            documents,
            hidden=mode.hidden,
            layers=mode.layers,
            heads=mode.heads,
            vocab_size=VOCAB,
            context=mode.block_size,
            seed=args.seed,
        )
        (root / "measure").mkdir()
        throughput = measure(documents, model_dir / "tokenizer.json", root / "measure", mode.prepare_runs)
        print(f"prepare: {json.dumps({k: v for k, v in throughput.items() if k != 'runs'})}", flush=True)
        prepared = prepare_dataset(documents, model_dir, root / "prepared", throughput["tokens"])
        runs: dict[str, Run] = {}
        base = spec_for(mode, model_dir, args.seed + 1, BASE_LR)  # its own batches: not the fine-tunes'
        runs["base"] = _report(run_single("base", base, prepared, save_to=root / "base"))
        full = spec_for(mode, root / "base", args.seed, FULL_LR)
        runs["full_single"] = _report(run_single("full_single", full, prepared))
        runs["full_diloco"] = _report(run_diloco("full_diloco", full, prepared))
        lora = spec_for(mode, root / "base", args.seed, LORA_LR, LORA)
        runs["lora_single"] = _report(run_single("lora_single", lora, prepared))
        runs["lora_diloco"] = _report(run_diloco("lora_diloco", lora, prepared))
        shards = [*(runs["full_diloco"].shards or []), *(runs["lora_diloco"].shards or [])]
        data = download_share(prepared, shards)
    summary = _summary(args, mode, runs, data, throughput)
    summary["wall_s"] = round(time.monotonic() - began, 1)
    summary["load_average"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("finetune-quick.json" if args.quick else "finetune.json")
    out.write_text(json.dumps({**summary, "runs": {k: asdict(r) for k, r in runs.items()}}, indent=1))
    print(json.dumps(summary))


def _report(run: Run) -> Run:
    print(
        f"  {run.name:12s} val {run.val_loss:.4f}  {run.tokens:,} tokens  {run.wall_s:6.1f}s  "
        f"{run.bytes_per_worker / 1e6:7.2f} MB/worker  {run.trainable_parameters:,} trained",
        flush=True,
    )
    return run


def _summary(
    args: argparse.Namespace, mode: Mode, runs: dict[str, Run], data: dict, throughput: dict
) -> dict[str, Any]:
    per_round = {kind: runs[f"{kind}_diloco"].bytes_per_worker / mode.rounds for kind in ("full", "lora")}
    ratio = per_round["lora"] / per_round["full"]
    gaps = {
        kind: (runs[f"{kind}_diloco"].val_loss - runs[f"{kind}_single"].val_loss)
        / runs[f"{kind}_single"].val_loss
        for kind in ("full", "lora")
    }
    share = data["worker_download_share"]
    return {
        "full_loss_gap": round(gaps["full"], 4),
        "lora_loss_gap": round(gaps["lora"], 4),
        "full_bytes_per_round": round(per_round["full"]),
        "lora_bytes_per_round": round(per_round["lora"]),
        "lora_bytes_ratio": round(ratio, 5),
        **{
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in data.items()
            if k != "worker_download_shares"
        },
        "prepare_tokens_per_s": throughput["prepare_tokens_per_s"],
        "tokenizer_direct_tokens_per_s": throughput["tokenizer_direct_tokens_per_s"],
        "prepare_ratio": throughput["ratio"],
        "targets": {
            "lora_bytes_ratio": ratio <= TARGETS["lora_bytes_ratio"],
            "worker_download_share": share <= data["worker_download_share_target"],
            "prepare_ratio": throughput["ratio"] >= TARGETS["prepare_ratio"],
        },
        "val_loss": {name: round(run.val_loss, 4) for name, run in runs.items()},  # base: before fine-tuning
        "run_wall_s": {name: round(run.wall_s, 1) for name, run in runs.items()},
        "parameters": runs["full_single"].trainable_parameters,
        "lora_trainable_parameters": runs["lora_single"].trainable_parameters,
        "tokens_trained": {name: run.tokens for name, run in runs.items()},
        "rounds": mode.rounds,
        "inner_steps": mode.inner_steps,
        "workers": WORKERS,
        "cores": os.cpu_count(),
        "prepare": {k: v for k, v in throughput.items() if k != "runs"},
        "settings": {
            "mode": "quick" if args.quick else "default",
            "data": args.data,
            "seed": args.seed,
            "model": {"hidden": mode.hidden, "layers": mode.layers, "heads": mode.heads, "vocab": VOCAB},
            "block_size": mode.block_size,
            "batch_size": mode.batch_size,
            "eval_batches": mode.eval_batches,
            "lora": LORA,
            "lr": {"base": BASE_LR, "full": FULL_LR, "lora": LORA_LR},
            "compression": INT8.compression.model_dump(),
            "outer_lr": INT8.outer_lr,
            "outer_momentum": INT8.outer_momentum,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
