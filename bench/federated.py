"""Federated training on private, non-IID shards: our FedAvg against one process on the pooled data, DP-FedAvg
at three noise levels, and Flower's FedAvg on the same model, split and rounds.

    python bench/federated.py              # the reported mode (see bench/README.md)
    python bench/federated.py --quick      # smaller runs: under 6 minutes on 2 cores
    python bench/federated.py --data DIR   # the UTF-8 text files under DIR instead of the stdlib's source

The text (the standard library's ``.py`` sources by default) is cut into classes, one per top-level
package (top-level modules form one class); 1 file in ``HOLDOUT``, counting through the classes, goes to
a held-out set, and the rest of each class is split between ``OWNERS`` owners with a Dirichlet(``ALPHA``
= 0.3) draw per class, so owners differ in size and in what they hold (non-IID). Each owner's text is
prepared (byte tokens, as ``gpuflex data prepare --bytes``) into its own directory; so are the pooled
owners' text and the held-out text, which scores every run (``eval_batches`` batches of windows evenly
spaced over all of it).

What runs, all with ``char-gpt`` and the same seed, AdamW, lr schedule and batches per inner step:

- ``federated``: a federated job (``data.federated``) in our training runtime, in process: the aggregator
  (``run_aggregator``) and one worker per owner (``run_worker``, reading only its owner's directory) as
  threads over one ``LocalTransport``: the code a provider's task runs, without the processes and the
  HTTP. Not a ``gpuflex.localnet`` network: a coordinator and five agents take longer to start than this
  bench's test may run. FedAvg by tokens (``TaskConfig.weights``: each owner's train tokens), fp32 on the
  wire (``compression: none``) and the outer step FedAvg takes (lr 1, no momentum), so Flower's FedAvg
  is the same algorithm.
- ``pooled-<draw>``: one process on the pooled owners' data with the same tokens: ``rounds x
  inner_steps`` steps, each on ``OWNERS`` times a worker's batch; ``POOLED_DRAWS`` times, with different
  batch draws (the same initial model).
- ``dp``: the federated job with ``privacy.dp: {clip, noise_multiplier, delta}`` at each of the mode's
  noise multipliers (workers clip, the aggregator's ``private_mean`` clips again and adds the noise), and
  the ε each reaches over its rounds by our accountant, as the coordinator's ledger records it
  (``coordinator.services.dp.epsilon``).
- ``flower``: Flower's ``FedAvg`` strategy (``flwr.server.strategy``) aggregating Flower ``NumPyClient``s,
  in process: its simulation engine needs Ray (``flwr[simulation]`` pins ray 2.55.1), so the server loop
  is this file's, calling the strategy's ``aggregate_fit`` with each client's ``FitRes``. Each client
  trains with our worker's ``Replica.train_round`` (same steps, seeds and optimizer state as our worker),
  and reports its owner's train tokens as ``num_examples``: the two runs differ only in who averages.

Fields of the JSON line (the last of stdout; ``bench/results/federated[-quick].json`` holds the same):

- ``federated_loss_gap``: (the federated job's final held-out loss - the pooled runs' mean) / that mean;
  ``pooled_val_loss`` and ``pooled_val_loss_std``: the pooled runs' mean and standard deviation;
- ``dp``: per noise multiplier, the clip, ε at ``DELTA`` after the job's rounds, the final loss, and
  ``noise_std``, the noise on each value of the averaged update (z · clip · the largest owner's share);
- ``flower``: Flower's final loss and wall seconds beside ours (or ``skipped`` without ``flwr``);
- ``owners``: each owner's train tokens and its share of each class's bytes; then losses, tokens, wall
  seconds (from round 0 published, or the first step, to the end of training) and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import federated_secagg
import numpy as np
import torch

from gpuflex.coordinator.services import dp as dp_ledger
from gpuflex.data.assign import validation_batches
from gpuflex.data.fetch import LocalShards
from gpuflex.data.manifest import Manifest, read_manifest
from gpuflex.privacy import dp
from gpuflex.protocol.messages import TaskConfig
from gpuflex.protocol.spec import JobSpec, TrainingSpec, parse_job_spec
from gpuflex.testing import prepare_bytes
from gpuflex.train.aggregator import run_aggregator
from gpuflex.train.corpus import STDLIB
from gpuflex.train.data import round_generator
from gpuflex.train.outer import load_model
from gpuflex.train.precision import InnerStep
from gpuflex.train.recipes import build_model, evaluate, get_recipe
from gpuflex.train.recipes.prepared import federated_data, task_data
from gpuflex.train.schedule import set_lr
from gpuflex.train.transport import LocalTransport
from gpuflex.train.worker import Replica, inner_optimizer, run_worker, step

# -- settings ---------------------------------------------------------------------------------------
OWNERS = 4
ALPHA = 0.3  # Dirichlet concentration of each class over the owners: small is skewed
HOLDOUT = 10  # 1 file in HOLDOUT, counting through the classes, is held out: the text that scores runs
DELTA = 1e-5  # the δ every DP run's ε is reported at
DATASET = "records"  # the private datasets' name (data.federated)
POLL_S = 0.02  # how often tasks poll for a round: threads in one process, nothing to spare
RESULTS = Path(__file__).parent / "results"
POOLED_DRAWS = 3  # the pooled run's batch draws: its loss moves several % with them at these sizes
FLOWER_MISSING = "flwr not installed: pip install -e '.[flower]'"


@dataclass(frozen=True)
class Mode:
    """How big the runs are."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int  # sequences per inner step of a worker
    rounds: int
    inner_steps: int
    eval_batches: int  # held-out batches every run is scored on
    text_bytes: int  # at most this much of the text
    clip: float  # privacy.dp.clip: an L2 bound on each owner's pseudo-gradient per round
    noise: tuple[float, ...]  # privacy.dp.noise_multiplier of each DP run


TINY = Mode(1, 2, 16, 32, 4, 2, 3, 4, 300_000, 1.0, (0.01, 1.0))  # tests/bench: seconds
QUICK = Mode(2, 2, 64, 64, 16, 8, 20, 32, 3_000_000, 1.0, (0.01, 0.1, 1.0))
DEFAULT = Mode(2, 2, 64, 64, 16, 16, 40, 64, 8_000_000, 1.0, (0.01, 0.1, 1.0))  # quick's model, 4x the steps


@dataclass
class Run:
    """One training run's outcome on the held-out batches."""

    name: str
    val_loss: float
    tokens: int
    wall_s: float  # the training: from round 0 published (federated) or the first step to the end
    epsilon: float | None = None
    noise_multiplier: float | None = None


@dataclass
class Split:
    """The text cut into the owners' shares and the held-out share."""

    owners: list[list[str]]  # each owner's documents (files)
    holdout: list[str]
    class_shares: dict[str, list[float]] = field(default_factory=dict)  # each class's bytes per owner


# -- the data ---------------------------------------------------------------------------------------
def corpus_classes(source: str, max_bytes: int, seed: int) -> dict[str, list[str]]:
    """The ``.py`` files under ``source`` (``stdlib``, or a directory: then every UTF-8 file), grouped by
    top-level directory; files drawn at random (seeded) until ``max_bytes``, each class's in path order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if source == STDLIB else Path(source).expanduser()
    pattern = "*.py" if source == STDLIB else "*"
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    paths = sorted(
        p for p in root.rglob(pattern) if p.is_file() and not skip & set(p.relative_to(root).parts)
    )
    order = np.random.default_rng(seed).permutation(len(paths))
    chosen: dict[Path, str] = {}
    total = 0
    for i in order:
        try:
            text = paths[i].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        chosen[paths[i]] = text
        total += len(text.encode())
        if total >= max_bytes:
            break
    classes: dict[str, list[str]] = {}
    for path in sorted(chosen):
        parts = path.relative_to(root).parts
        classes.setdefault(parts[0] if len(parts) > 1 else "(top level)", []).append(chosen[path])
    return classes


def dirichlet_split(classes: dict[str, list[str]], owners: int, alpha: float, seed: int) -> Split:
    """Every ``HOLDOUT``-th document (counting through the classes in order) held out; the rest of each
    class cut between ``owners`` in proportions drawn from Dirichlet(``alpha``), by bytes, documents kept
    whole and in order."""
    rng = np.random.default_rng(seed)
    split = Split([[] for _ in range(owners)], [])
    counted = 0
    for name, documents in classes.items():
        kept = []
        for document in documents:
            counted += 1
            (split.holdout if counted % HOLDOUT == 0 else kept).append(document)
        sizes = np.array([len(d.encode()) for d in kept], dtype=float)
        bounds = np.cumsum(rng.dirichlet([alpha] * owners)) * sizes.sum()
        middles = np.cumsum(sizes) - sizes / 2  # a document goes where its middle byte falls
        shares = [0.0] * owners
        for document, middle, size in zip(kept, middles, sizes, strict=True):
            owner = min(int(np.searchsorted(bounds, middle)), owners - 1)
            split.owners[owner].append(document)
            shares[owner] += size
        split.class_shares[name] = [round(s / max(sizes.sum(), 1), 3) for s in shares]
    return split


def prepare_text(documents: list[str], out: Path, *, shards: int, val_tokens: int) -> Path:
    """``documents`` as one text file each, prepared as byte tokens into about ``shards`` train shards."""
    text = out.parent / f"{out.name}-text"
    text.mkdir(parents=True)
    width = len(str(len(documents)))
    for i, document in enumerate(documents):
        (text / f"{i:0{width}d}.txt").write_text(document)
    tokens = sum(len(d.encode()) + 1 for d in documents)
    return prepare_bytes(text, out, shard_tokens=max(1, -(-tokens // shards)), val_tokens=val_tokens)


def held_out_batches(holdout: Path, mode: Mode) -> list:
    """``mode.eval_batches`` batches of windows evenly spaced over all of the held-out text."""
    manifest, reader = read_manifest(holdout), LocalShards(holdout)
    parts = [reader.open(s, manifest.dtype) for s in [*manifest.train, *manifest.validation]]
    return validation_batches(parts, mode.eval_batches, mode.batch_size, mode.block_size)


# -- the runs ---------------------------------------------------------------------------------------
def job_spec(mode: Mode, seed: int, noise_multiplier: float | None = None) -> JobSpec:
    """The federated job as a consumer submits it (DP with ``noise_multiplier``)."""
    privacy = {} if noise_multiplier is None else {
        "dp": {"clip": mode.clip, "noise_multiplier": noise_multiplier, "delta": DELTA}
    }  # fmt: skip
    return parse_job_spec(
        {
            "name": "federated-bench",
            "resources": {"workers": OWNERS},
            "training": {
                "seed": seed,
                "rounds": mode.rounds,
                "inner_steps": mode.inner_steps,
                "batch_size": mode.batch_size,
                "model": {
                    "n_layer": mode.n_layer,
                    "n_head": mode.n_head,
                    "n_embd": mode.n_embd,
                    "block_size": mode.block_size,
                },
                "compression": "none",
                "outer_lr": 1.0,  # FedAvg: the new global model is the average of the owners'
                "outer_momentum": 0.0,
                "round_timeout_s": 3600,  # every owner is waited for
            },
            "data": {"federated": DATASET},
            "budget": 1.0,
            "privacy": privacy,
        }
    )


def task_configs(job: JobSpec, owners: list[Path]) -> list[TaskConfig]:
    """The aggregator's config and each owner's worker's, as the coordinator leases them."""
    privacy = dp_ledger.task(job)  # privacy.dp resolved as the coordinator resolves it for the tasks
    manifests = [read_manifest(d) for d in owners]
    common = {
        "job_id": "federated-bench",
        "num_workers": len(owners),
        "training": job.training,
        "federated": DATASET,
        "dp": privacy,
    }
    workers = [
        TaskConfig(task_id=f"worker-{i}", role="worker", worker_index=i, dataset=m.digest, **common)
        for i, m in enumerate(manifests)
    ]
    weights = {w.task_id: m.train_tokens for w, m in zip(workers, manifests, strict=True)}
    aggregator = TaskConfig(
        task_id="aggregator", role="aggregator", worker_index=0, weights=weights, **common
    )
    return [aggregator, *workers]


def run_federated(name: str, job: JobSpec, owners: list[Path], validation: list) -> Run:
    """The job's aggregator and workers as threads over one ``LocalTransport``; its final checkpoint
    scored on ``validation``."""
    aggregator, *workers = task_configs(job, owners)
    last = dp_ledger.last_round(job)
    hub = LocalTransport(last, live_workers=len(workers))
    failures: list[BaseException] = []
    stop = threading.Event()  # one task's failure stops the others, which would wait for it

    def run(task: Callable[..., object], config: TaskConfig, **reader: LocalShards) -> None:
        try:
            task(
                config,
                hub.for_task(config.task_id),
                poll_interval_s=POLL_S,
                should_stop=stop.is_set,
                **reader,
            )
        except BaseException as err:  # re-raised in the bench's thread
            failures.append(err)
            stop.set()

    threads = [threading.Thread(target=run, args=(run_aggregator, aggregator), daemon=True)]
    threads += [
        threading.Thread(target=run, args=(run_worker, c), kwargs={"reader": LocalShards(d)}, daemon=True)
        for c, d in zip(workers, owners, strict=True)
    ]
    for t in threads:
        t.start()
    while hub.latest_round() is None and any(t.is_alive() for t in threads):
        time.sleep(POLL_S)  # the clock starts at round 0, the model built: where Flower's starts
    began = time.monotonic()
    for t in threads:
        t.join()
    wall = time.monotonic() - began
    if failures:
        raise failures[0]
    final = hub.history()[-1]
    assert final.round == last and final.checkpoint is not None, "the last round carries the full state"
    model = build_model(job.training)
    load_model(model, hub.get_blob(final.checkpoint))
    return Run(
        name,
        _score(job.training, model, validation),
        final.tokens,
        wall,
        dp_ledger.epsilon(job, last),  # what the coordinator's ledger stores with the last round
        aggregator.dp.noise_multiplier if aggregator.dp else None,
    )


def run_pooled(spec: TrainingSpec, pooled: Path, validation: list, draw: int) -> Run:
    """One process on the pooled owners' data with the federated job's tokens: a worker's steps, each on
    ``OWNERS`` times its batch, on the same lr schedule; ``draw`` seeds its batches."""
    recipe = get_recipe(spec.recipe)
    model = build_model(spec, recipe)
    wide = spec.model_copy(update={"batch_size": spec.batch_size * OWNERS})
    data = task_data(read_manifest(pooled), LocalShards(pooled), wide, 0, 1)
    optimizer, inner = inner_optimizer(model, spec), InnerStep.for_spec(spec, torch.device("cpu"))
    generator = round_generator(spec.seed, 0, draw)
    steps = spec.rounds * spec.inner_steps
    model.train()
    began = time.monotonic()
    for k in range(steps):
        set_lr(optimizer, spec, k / steps)
        step(recipe, model, model, optimizer, data.sample(generator), inner=inner)
    wall = time.monotonic() - began
    return Run(f"pooled-{draw}", _score(spec, model, validation), steps * data.tokens_per_batch, wall)


def run_flower(job: JobSpec, owners: list[Path], validation: list) -> Run:
    """Flower's FedAvg over Flower clients that train as our workers do (``Replica.train_round``)."""
    from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    spec = job.training
    recipe = get_recipe(spec.recipe)
    model = build_model(spec, recipe)
    names = list(dict(model.named_parameters()))
    configs = task_configs(job, owners)[1:]  # the workers'
    clients = [_flower_client(recipe, c, d, names) for c, d in zip(configs, owners, strict=True)]
    strategy = FedAvg(min_fit_clients=len(clients), min_available_clients=len(clients))
    parameters = ndarrays_to_parameters([p.detach().numpy().copy() for p in model.parameters()])
    began = time.monotonic()
    for server_round in range(1, spec.rounds + 1):
        instructions = FitIns(parameters, {"round": server_round - 1})
        results = [(None, client.fit(instructions)) for client in clients]  # no proxies: in process
        aggregated, _ = strategy.aggregate_fit(server_round, results, [])
        assert aggregated is not None, "every client's fit succeeded"
        parameters = aggregated
    wall = time.monotonic() - began
    with torch.no_grad():
        for p, value in zip(model.parameters(), parameters_to_ndarrays(parameters), strict=True):
            p.copy_(torch.from_numpy(value))
    trained = spec.rounds * spec.inner_steps * spec.batch_size * spec.model.block_size * len(owners)
    return Run("flower", _score(spec, model, validation), trained, wall)


def _flower_client(recipe: Any, config: TaskConfig, owner: Path, names: list[str]) -> Any:
    """A Flower client (``NumPyClient.to_client()``) whose fit is our worker's round on its owner's data;
    its ``num_examples``, FedAvg's weight, is the owner's train tokens, as in ``TaskConfig.weights``."""
    from flwr.client import NumPyClient

    replica = Replica(config, recipe, federated_data(config, LocalShards(owner)))
    tokens = read_manifest(owner).train_tokens

    class Owner(NumPyClient):
        def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
            start = {n: torch.from_numpy(v.copy()) for n, v in zip(names, parameters, strict=True)}
            result = replica.train_round(start, int(config["round"]), lambda: False)
            assert result is not None
            trained = [(start[n] - result.delta[n]).numpy() for n in names]
            return trained, tokens, {"train_loss": result.train_loss}

    return Owner().to_client()


def _score(spec: TrainingSpec, model: torch.nn.Module, validation: list) -> float:
    loss = evaluate(get_recipe(spec.recipe), model, validation)
    assert loss is not None
    return loss


def flower_available() -> bool:
    try:
        import flwr  # noqa: F401
    except ImportError:
        return False
    return True


# -- the bench --------------------------------------------------------------------------------------
def measure(mode: Mode, source: str, seed: int, workdir: Path) -> dict[str, Any]:
    """Every run of ``mode`` on ``source``'s text in ``workdir``: the summary, with each run's outcome."""
    split = dirichlet_split(corpus_classes(source, mode.text_bytes, seed), OWNERS, ALPHA, seed)
    job = job_spec(mode, seed)
    spec = job.training
    block = spec.model.block_size
    owners = [
        prepare_text(docs, workdir / f"owner-{i}", shards=4, val_tokens=block + 1)
        for i, docs in enumerate(split.owners)
    ]
    pooled = [d for docs in split.owners for d in docs]
    pooled_dir = prepare_text(pooled, workdir / "pooled", shards=4 * OWNERS, val_tokens=block + 1)
    holdout = prepare_text(split.holdout, workdir / "holdout", shards=1, val_tokens=block + 1)
    validation = held_out_batches(holdout, mode)
    runs: dict[str, Run] = {}
    runs["federated"] = _report(run_federated("federated", job, owners, validation))
    for draw in range(POOLED_DRAWS):
        runs[f"pooled-{draw}"] = _report(run_pooled(spec, pooled_dir, validation, draw))
    for z in mode.noise:
        runs[f"dp-{z:g}"] = _report(run_federated(f"dp-{z:g}", job_spec(mode, seed, z), owners, validation))
    if flower_available():
        runs["flower"] = _report(run_flower(job, owners, validation))
    return _summary(mode, runs, [read_manifest(d) for d in owners], split)


def _summary(mode: Mode, runs: dict[str, Run], manifests: list[Manifest], split: Split) -> dict[str, Any]:
    fed = runs["federated"]
    pooled = [run.val_loss for name, run in runs.items() if name.startswith("pooled-")]
    mean = statistics.mean(pooled)
    weights = [float(m.train_tokens) for m in manifests]
    return {
        "federated_loss_gap": round((fed.val_loss - mean) / mean, 4),
        "pooled_val_loss": round(mean, 4),
        "pooled_val_loss_std": round(statistics.stdev(pooled), 4) if len(pooled) > 1 else 0.0,
        "dp": [
            {
                "noise_multiplier": run.noise_multiplier,
                "clip": mode.clip,
                "epsilon": round(run.epsilon, 3) if run.epsilon is not None else None,
                "delta": DELTA,
                "val_loss": round(run.val_loss, 4),
                "noise_std": round(dp.mean_noise_std(mode.clip, run.noise_multiplier, weights), 5),
            }
            for name, run in runs.items()
            if name.startswith("dp-") and run.noise_multiplier is not None
        ],
        "flower": flower_summary(runs),
        "val_loss": {name: round(run.val_loss, 4) for name, run in runs.items()},
        "run_wall_s": {name: round(run.wall_s, 1) for name, run in runs.items()},
        "tokens_trained": {name: run.tokens for name, run in runs.items()},
        "owners": {
            "train_tokens": [m.train_tokens for m in manifests],
            "holdout_documents": len(split.holdout),
            "class_shares": split.class_shares,
        },
        "parameters": sum(p.numel() for p in build_model(job_spec(mode, 0).training).parameters()),
    }


def flower_summary(runs: dict[str, Run]) -> dict[str, Any]:
    """Flower's loss and wall time beside ours, or why there are none."""
    if "flower" not in runs:
        return {"skipped": FLOWER_MISSING}
    import flwr

    flower, ours = runs["flower"], runs["federated"]
    return {
        "val_loss": round(flower.val_loss, 4),
        "wall_s": round(flower.wall_s, 1),
        "ours": {"val_loss": round(ours.val_loss, 4), "wall_s": round(ours.wall_s, 1)},
        "loss_difference": round(flower.val_loss - ours.val_loss, 5),
        "api": "flwr.server.strategy.FedAvg.aggregate_fit in process (its simulation engine needs Ray)",
        "version": flwr.__version__,
    }


def _report(run: Run) -> Run:
    extra = f"  ε {run.epsilon:.3g} (z {run.noise_multiplier:g})" if run.epsilon is not None else ""
    print(
        f"  {run.name:10s} val {run.val_loss:.4f}  {run.tokens:,} tokens  {run.wall_s:6.1f}s{extra}",
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs: under 6 minutes on 2 cores")
    parser.add_argument("--data", default=STDLIB, help="a directory of text files (default: the stdlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mode = QUICK if args.quick else DEFAULT
    torch.set_num_threads(1)  # as each provider's task would have one core of its own
    began, load_before = time.monotonic(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gpuflex-federated-") as tmp:
        summary = measure(mode, args.data, args.seed, Path(tmp))
    summary.update(federated_secagg.measure(args.quick))  # secagg_bytes_ratio, _time_overhead, dropout
    summary["wall_s"] = round(time.monotonic() - began, 1)
    summary["load_average"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    summary["settings"] = {
        "mode": "quick" if args.quick else "default",
        "data": args.data,
        "seed": args.seed,
        "owners": OWNERS,
        "alpha": ALPHA,
        **asdict(mode),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("federated-quick.json" if args.quick else "federated.json")).write_text(
        json.dumps(summary, indent=1)
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
