"""A GPUFlex worker's and replica's memory against a plain training loop's and transformers' generate.

    python bench/memory.py --quick               # 10M, 40M and 135M llama shapes: under 10 minutes on 2 cores
    python bench/memory.py --model DIR           # the 135M case from a real model (scripts/get-smollm2)
    python bench/memory.py --device cuda         # on a GPU (scripts/gpu-check runs it there)

Every case runs twice, each in a fresh process, measured the same way: **plain**, a transformers model with
the same optimizer (AdamW, torch's), precision, batch and steps, its loss from ``labels=`` as transformers
computes it, with peft's LoRA where the case is LoRA; and **worker**, GPUFlex's worker (``train.worker.
Replica``: the model laid out by ``train.placement``, the global replica, the tracer, error feedback) taking
the same steps as DiLoCo rounds, each sealed (compressed) and its update applied to the global replica, and
one audit answered (its drawn segment re-derived by re-running, ``commitment.RoundTrace``). Both start from
the same ``save_pretrained`` directory (llama-shaped, seeded; the 135M case is SmolLM2-135M's shape, or the
real model with ``--model``) and train on the same random token batches.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` (what the device holds); on a CPU the process's peak RSS
above its own baseline (the high-water mark reset, through ``/proc/self/clear_refs``, once the imports and the
data are in). On a CPU, host and device are one memory: the worker's **device** figure is its peak less what
``train.placement`` keeps in host memory (the global replica, the outer momentum, the residuals, the kept
trace states: counted tensor by tensor, all of them alive at the peak), which on a GPU node never takes VRAM;
its whole-process figure is reported beside it (``rss``). Speed: tokens over the seconds of the steps (the
worker's include its tracing; its first round is left out of both, with the allocator's and the optimizer's
first-step costs).

The replica case loads the 135M model as a deployment's replica does (``serve.model.ServedModel`` and the
``serve.engine.Engine``, continuous batching) and generates a batch of requests, against transformers'
``generate`` of the same model, batch and lengths.

Fields of the JSON line (the last of stdout; ``bench/results/memory[-quick].json`` holds the same):

- ``worker_vs_plain_peak``: per mode (``full``, ``lora``), the largest over sizes of the worker's device
  peak over the plain loop's (target <= 1.15); ``worker_vs_plain_rss`` the same for the whole process;
- ``worker_vs_plain_tokens_per_s``: a full fine-tune of the smallest size over rounds of 32 steps, 8 segments
  of 4, as a job's rounds are (target >= 0.9; ``speed`` has both sides' tokens/s);
  ``worker_vs_plain_tokens_per_s_every_step_a_boundary``: the smallest over the memory cases, whose rounds
  of 2-4 steps trace every step (hash it, keep some): verification's cost at its most;
- ``replica_vs_generate_peak`` (target <= 1.2);
- ``estimate_over_measured``: per case, ``market.memory``'s device bytes (with its margin, without the CUDA
  context a CPU process has not) over the worker's measured device peak (target 1.0-1.3);
- ``table``: the market's estimates (GB, with the CUDA context) of the issue's four jobs and a 70B QLoRA
  sharded over two 24 GB cards, with their targets;
- ``trace``: the trade the tracer makes: host bytes of every boundary state against the start's alone, the
  seconds an audit's answer took (its re-run and its blob) against the round's, and the prover's expected
  extra compute at the network's audit rate (the 135M full case answers none: its blob, 36 bytes a
  parameter, 4.8 GB, is the host's whole margin on 2 cores and 23 GB);
- ``bytes_per_parameter``: per case, plain and worker (device), so the scaling is visible; ``cases``: all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary, tied head
    "10M": (256, 6, 4, 4, 1024, 8192, False),
    "40M": (512, 8, 8, 8, 2048, 8192, False),
    "135M": (576, 30, 9, 3, 1536, 49152, True),  # SmolLM2-135M's
}
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
AUDIT_RATE = 0.05  # the network's default (verification.audit_rate)
TARGETS = {"peak": 1.15, "tokens_per_s": 0.9, "replica": 1.2, "estimate": (1.0, 1.3)}


@dataclass(frozen=True)
class Case:
    size: str
    mode: str  # full | lora
    precision: str
    batch: int
    block: int
    rounds: int
    inner_steps: int
    audit: bool = True  # answer one audit after the rounds (its re-run and its blob)

    @property
    def name(self) -> str:
        return f"{self.size}-{self.mode}"

    def training(self, model_dir: str) -> dict:
        """The job's training section: what the worker runs and the plain loop mirrors."""
        return {
            "recipe": "hf-causal-lm",
            "model": {"from": model_dir, "block_size": self.block},
            "rounds": self.rounds + MEASURED + 1,
            "inner_steps": self.inner_steps,
            "batch_size": self.batch,
            "precision": self.precision,
            "lr": 1e-4,
            "lr_schedule": "constant",
            "lora": LORA if self.mode == "lora" else None,
            "compression": "int8",
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: under 10 minutes on 2 cores")
    parser.add_argument("--model", type=Path, help="a model directory for the 135M case (e.g. SmolLM2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--sizes", default="10M,40M,135M", help="of " + ", ".join(SHAPES))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one side of one case, in a fresh process
    args = parser.parse_args()
    if args.case:
        spec = json.loads(args.case)
        Path(spec["out"]).write_text(json.dumps(_run_case(spec)))
        return
    report = run(args)
    out = Path(__file__).parent / "results" / f"memory{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


def run(args: argparse.Namespace) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    began = time.monotonic()
    cases, results = [], []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for size in sizes:
            model_dir = args.model if size == "135M" and args.model else _save(Path(tmp) / size, SHAPES[size])
            steps = 2 if args.quick and size == "135M" else 4
            for mode in ("full", "lora"):
                precision = "fp32" if mode == "full" else "bf16"
                audit = not (size == "135M" and mode == "full")  # its answer alone: 36 B a parameter
                case = Case(size, mode, precision, 4, 128, rounds=2, inner_steps=steps, audit=audit)
                cases.append(case)
                results.append(_compare(case, _sides(case, str(model_dir), device), device))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        speed = Case(
            sizes[0], "full", "fp32", 4, 128, rounds=1 if args.quick else 2, inner_steps=32, audit=False
        )
        speed_dir = args.model if speed.size == "135M" and args.model else Path(tmp) / speed.size
        speed_sides = _sides(speed, str(speed_dir), device)
        largest = Path(args.model) if args.model else Path(tmp) / sizes[-1]
        replica = {side: _subprocess(None, side, str(largest), device) for side in ("generate", "replica")}
    report = _summary(results, speed_sides, replica, device, time.monotonic() - began)
    report["model"] = str(args.model) if args.model else "random init (save_pretrained of each shape)"
    return report


def _save(directory: Path, shape: tuple) -> Path:
    """A seeded llama of ``shape`` saved as a model directory, its weights in bf16 as real ones are."""
    import torch
    import transformers

    from gpuflex.testing import train_bpe

    hidden, layers, heads, kv_heads, intermediate, vocab, tied = shape
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    eos = "<|endoftext|>"  # a tokenizer too, as a replica needs one: trained on a few lines, nothing fetched
    documents = [Path(json.__file__).read_text(), Path(argparse.__file__).read_text()]
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(documents, 1024, eos), eos_token=eos
    )
    tokenizer.save_pretrained(directory)
    return directory


def _subprocess(case: Case | None, side: str, model_dir: str, device: str) -> dict:
    """One side of one case in a fresh process; its result comes back in a file (the profiler prints on
    stdout)."""
    out = Path(tempfile.mkdtemp(prefix="bench-memory-case-")) / "result.json"
    spec = {"case": None if case is None else asdict(case), "side": side, "model": model_dir}
    spec |= {"device": device, "out": str(out)}
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side} of {case}: exit {done.returncode}\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent)
    return result


# -- one side of one case, in its own process -------------------------------------------------------------


class Meter:
    """Peak memory above a baseline taken when it is made. ``window``: tensor storage in one window
    (``begin`` .. ``end``): CUDA's allocator statistics, or on a CPU the tensors alive when the window opens
    (their storages, each once) plus the running sum of the profiler's allocation events inside it.
    ``rss``: the process's peak RSS since it was made (its high-water mark reset through
    ``/proc/self/clear_refs``)."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.window: int | None = None
        self._profiler = None
        if self.cuda:
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = live_tensor_bytes()
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_base = _status("VmRSS")

    def begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        self._start = live_tensor_bytes()
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.start()

    def end(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.window = torch.cuda.max_memory_allocated() - self.base
            return
        assert self._profiler is not None, "begin first"
        self._profiler.stop()
        events = [e for e in self._profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        running = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            running += event.nbytes()
            peak = max(peak, running)
        self.window = self._start + peak - self.base

    def rss(self) -> int | None:
        return None if self.cuda else _status("VmHWM") - self.rss_base


def live_tensor_bytes() -> int:
    """The bytes of every CPU tensor storage alive, each storage once."""
    import gc

    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class LastStep:
    """A worker's ``after_step``: opens the meter's window before the last step of the round measured
    (``MEASURED``), closes it after: a round's steady state, its optimizer moments, outer momentum and
    residual allocated and the round before it dropped. The previous step's gradients go first, as the step
    would free them: the profiler sees no free of what was allocated before its window, which would count
    them twice."""

    def __init__(self, meter: Meter, steps: int, optimizer):
        self.meter, self.optimizer, self.done = meter, optimizer, 0
        self.steps = (MEASURED + 1) * steps

    def __call__(self, _seconds: float) -> None:
        self.done += 1
        if self.done == self.steps - 1:
            self.optimizer.zero_grad(set_to_none=True)
            self.meter.begin()
        elif self.done == self.steps:
            self.meter.end()


MEASURED = 1  # the round whose last step is measured (the first warms up); the ones after it are timed


def _sides(case: Case, model_dir: str, device: str) -> dict:
    return {side: _subprocess(case, side, model_dir, device) for side in ("plain", "worker")}


def _run_case(spec: dict) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if spec["case"] is None:
        return _generate(spec) if spec["side"] == "generate" else _replica(spec)
    case = Case(**spec["case"])
    return (_plain if spec["side"] == "plain" else _worker)(case, spec["model"], spec["device"])


def _batches(case: Case, vocab: int, count: int) -> list:
    """The same random token windows for both sides (inputs, next-token targets)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (case.batch, case.block + 1), generator=generator)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _plain(case: Case, model_dir: str, device: str) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    steps = case.rounds * case.inner_steps
    last = (MEASURED + 1) * case.inner_steps - 1  # the step measured: the last of round MEASURED
    batches = _batches(case, vocab, steps + last + 1)
    meter = Meter(device)
    dtype = torch.bfloat16 if case.mode == "lora" and case.precision == "bf16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    if case.mode == "lora":
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA["target_modules"])
        )
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    autocast = torch.autocast(device, torch.bfloat16, enabled=case.precision == "bf16")
    seconds = 0.0
    for i, (inputs, _) in enumerate(batches):
        if i == last:  # a round's steady state, as the worker's
            meter.begin()
        began = time.perf_counter()
        with autocast:
            # transformers shifts the labels itself: the inputs' next tokens, the last position unscored
            loss = model(input_ids=inputs.to(device), labels=inputs.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i == last:
            meter.end()
        if i > last:  # the first rounds' worth warms up and is measured, as the worker's first rounds are
            seconds += time.perf_counter() - began
    tokens_per_s = steps * case.batch * case.block / seconds
    return {"peak": meter.window, "rss": meter.rss(), "tokens_per_s": tokens_per_s}


def _worker(case: Case, model_dir: str, device: str) -> dict:
    import torch

    from gpuflex.protocol.messages import TaskConfig
    from gpuflex.protocol.spec import TrainingSpec
    from gpuflex.train.pretrained import sized
    from gpuflex.train.recipes import TaskData, get_recipe
    from gpuflex.train.worker import Replica

    spec = sized(TrainingSpec.model_validate(case.training(model_dir)))
    assert spec.model.size is not None and spec.model.size.vocab is not None
    rounds = MEASURED + 1 + case.rounds
    batches = _batches(case, spec.model.size.vocab, rounds * case.inner_steps)
    drawn = iter(batches * 4)  # the re-run of an audit draws its round's batches again
    data = TaskData(
        sample=lambda _generator: next(drawn), validation=[], tokens_per_batch=case.batch * case.block
    )
    config = TaskConfig(job_id="j", task_id="w", role="worker", worker_index=0, num_workers=1, training=spec)
    meter = Meter(device)
    recipe = get_recipe("hf-causal-lm").from_directory(Path(model_dir), torch.device(device))
    replica = Replica(config, recipe, data)
    replica.after_step = LastStep(meter, case.inner_steps, replica.optimizer)
    seconds, last, host = 0.0, None, 0
    for label in range(rounds):
        last = None  # as a worker does: a round's states go once it is answered, before the next round's
        result = replica.train_round(replica.global_params(), label, lambda: False)
        blob, last = replica.seal(result)
        del result
        replica.global_.apply(replica.decode(blob))  # the outer step, as the round's update would be
        if label > MEASURED:  # the first rounds warm up and are measured: left out, as the plain loop's
            seconds += last.compute_s
        elif label == MEASURED:
            host = _host_bytes(replica, last, boundaries=len(last.trace.lrs))  # held at its last step
            replica.after_step = None
    assert last is not None
    rss = meter.rss()
    segments = len(last.trace.lrs)
    drawn = iter(batches[-case.inner_steps :] * 2)  # the last round's batches, from its first
    answer, replay_s, answering = None, None, Meter(device)  # an audit's answer, apart: on the host
    if case.audit:
        answering.begin()
        began = time.perf_counter()
        answer = last.audit_state(segments - 1)  # the last segment: the longest re-run
        replay_s = time.perf_counter() - began
        answering.end()
    steps = case.rounds * case.inner_steps
    per_boundary = _state_bytes(last.trace.kept[0])  # the round's start: a boundary's tensors, always kept
    return {
        "peak": meter.window,
        "rss": rss,
        "host": host,
        "tokens_per_s": steps * case.batch * case.block / seconds,
        "round_s": last.compute_s,
        "replay_s": replay_s,
        "audit_blob": None if answer is None else len(answer),
        "audit_peak": answering.window,
        "segments": segments,
        "kept": sorted(last.trace.kept),
        "boundary_bytes": per_boundary,
        "parameters": spec.model.size.parameters,
        "trained": spec.model.size.trainable,
        "estimate": _estimate(spec),
    }


def _host_bytes(replica, result, boundaries: int) -> int:
    """What ``train.placement`` keeps in host memory while a round's last step runs, each tensor's storage
    once: the global replica, its outer momentum, the residual, and the trace's states kept before the
    last boundary (the last one is copied after the step)."""
    tensors = [*replica.global_.parameters().values(), *replica.global_.buffers.values()]
    tensors += [b for state in replica.global_.outer.state.values() for b in state.values()]
    tensors += [*result.residual.values()]  # the residual the round's delta was compressed with
    tensors += [t for b, state in result.trace.kept.items() if b < boundaries for t in state.values()]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _estimate(spec) -> dict:
    from gpuflex.market.memory import MARGIN, worker_memory

    memory = worker_memory(spec)
    return {"device": memory.device_bytes * MARGIN, "host": memory.host}


def _generate(spec: dict) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    device = spec["device"]
    meter = Meter(device)
    meter.begin()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"]).to(device).eval()
    prompts = _prompts(model.config.vocab_size)
    with torch.inference_mode():
        model.generate(
            torch.tensor(prompts, device=device),
            max_new_tokens=GENERATED,
            do_sample=False,
            min_new_tokens=GENERATED,
        )
    meter.end()
    return {"peak": meter.window, "rss": meter.rss()}


def _replica(spec: dict) -> dict:
    from gpuflex.serve.engine import Engine
    from gpuflex.serve.model import ServedModel
    from gpuflex.serve.sampling import SamplingParams

    meter = Meter(spec["device"])
    meter.begin()
    served = ServedModel.load(spec["model"], device=spec["device"])
    engine = Engine(served, max_batch=REQUESTS)
    try:
        params = SamplingParams(max_tokens=GENERATED, temperature=0.0)
        requests = [engine.submit(list(p), params) for p in _prompts(served.model.config.vocab_size)]
        for request in requests:
            request.result()
    finally:
        engine.close()
    meter.end()
    return {"peak": meter.window, "rss": meter.rss()}


GENERATED = 64  # tokens generated per request
REQUESTS = 4  # decoded together


def _prompts(vocab: int) -> list[list[int]]:
    """``REQUESTS`` prompts of 256 tokens: the batch both servers decode."""
    import torch

    return torch.randint(3, vocab, (REQUESTS, 256), generator=torch.Generator().manual_seed(1)).tolist()


# -- the report ----------------------------------------------------------------------------------------


def _compare(case: Case, sides: dict, device: str) -> dict:
    plain, worker = sides["plain"], sides["worker"]
    host = worker["host"] if device == "cpu" else 0  # on CUDA the host part was never in the peak
    device_peak = worker["peak"] - host
    rss = None if plain["rss"] is None else worker["rss"] / plain["rss"]
    return {
        "case": case.name,
        "precision": case.precision,
        "parameters": worker["parameters"],
        "trained": worker["trained"],
        "plain_peak_mb": plain["peak"] / 2**20,
        "worker_peak_mb": device_peak / 2**20,
        "worker_host_mb": worker["host"] / 2**20,
        "worker_vs_plain_peak": device_peak / plain["peak"],
        "worker_vs_plain_rss": rss,
        "plain_tokens_per_s": plain["tokens_per_s"],
        "worker_tokens_per_s": worker["tokens_per_s"],
        "worker_vs_plain_tokens_per_s": worker["tokens_per_s"] / plain["tokens_per_s"],
        "estimate_mb": worker["estimate"]["device"] / 2**20,
        "estimate_host_mb": worker["estimate"]["host"] / 2**20,
        "estimate_over_measured": worker["estimate"]["device"] / device_peak,
        "bytes_per_parameter": {
            "plain": plain["peak"] / worker["parameters"],
            "worker": device_peak / worker["parameters"],
        },
        "trace": {
            k: worker[k]
            for k in ("segments", "kept", "boundary_bytes", "round_s", "replay_s", "audit_blob", "audit_peak")
        },
    }


def _summary(results: list[dict], speed: dict, replica: dict, device: str, wall_s: float) -> dict:
    """``speed``: the plain loop and the worker over rounds of 32 steps (8 segments of 4), the speed a job's
    inner loop keeps; the memory cases' rounds of 2-4 steps make every step a traced boundary."""

    def worst(mode: str, key: str) -> float:
        return max(r[key] for r in results if r["case"].endswith(mode))

    peak = {mode: worst(mode, "worker_vs_plain_peak") for mode in ("full", "lora")}
    rss = (
        None if device == "cuda" else {mode: worst(mode, "worker_vs_plain_rss") for mode in ("full", "lora")}
    )
    short_rounds = min(r["worker_vs_plain_tokens_per_s"] for r in results)
    ratio = speed["worker"]["tokens_per_s"] / speed["plain"]["tokens_per_s"]
    estimate = {r["case"]: r["estimate_over_measured"] for r in results}
    replica_ratio = replica["replica"]["peak"] / replica["generate"]["peak"]
    low, high = TARGETS["estimate"]
    return {
        "device": device,
        "worker_vs_plain_peak": peak,
        "worker_vs_plain_rss": rss,
        "worker_vs_plain_tokens_per_s": ratio,
        "worker_vs_plain_tokens_per_s_every_step_a_boundary": short_rounds,
        "speed": {side: speed[side]["tokens_per_s"] for side in ("plain", "worker")},
        "replica_vs_generate_peak": replica_ratio,
        "replica_peak_mb": replica["replica"]["peak"] / 2**20,
        "generate_peak_mb": replica["generate"]["peak"] / 2**20,
        "estimate_over_measured": estimate,
        "table": _table(),
        "trace": _trace(results),
        "bytes_per_parameter": {r["case"]: r["bytes_per_parameter"] for r in results},
        "targets": {
            "worker_vs_plain_peak<=1.15": all(v <= TARGETS["peak"] for v in peak.values()),
            "worker_vs_plain_tokens_per_s>=0.9": ratio >= TARGETS["tokens_per_s"],
            "replica_vs_generate_peak<=1.2": replica_ratio <= TARGETS["replica"],
            "estimate_over_measured_in_1.0-1.3": all(low <= v <= high for v in estimate.values()),
        },
        "cases": results,
        "threads": int(os.environ.get("BENCH_THREADS", "2")),
        "wall_s": wall_s,
    }


def _trace(results: list[dict]) -> dict:
    """Per case, the tracer's trade: every boundary's state in host memory against the start's alone (what
    it keeps now, within ``market.memory.SNAPSHOT_BUDGET``), and what re-deriving a drawn segment costs."""
    out = {}
    for r in results:
        t = r["trace"]
        segments, kept = t["segments"], set(t["kept"])
        every_boundary = t["boundary_bytes"] * (segments + 1)
        out[r["case"]] = {
            "kept_boundaries": t["kept"],
            "every_boundary_mb": every_boundary / 2**20,
            "rerun_s_last_segment": t["replay_s"],
            "round_s": t["round_s"],
            "expected_extra_compute": AUDIT_RATE * _rerun_share(segments, kept),
        }
    return out


def _rerun_share(segments: int, kept: set[int]) -> float:
    """The share of a round an audit's answer re-runs, on average over the segment drawn: segment k's answer
    holds boundaries k and k + 1 (the last, the final state, the model holds), and those not kept are
    re-derived from the kept boundary before the first of them (``commitment.RoundTrace.answer``)."""
    total = 0
    for k in range(segments):
        needed = {k, k + 1} - kept - {segments}
        if needed:
            total += max(needed) - max(b for b in kept if b <= min(needed))
    return total / segments / segments


def _table() -> dict:
    """The market's estimates (GB, CUDA context included) for the issue's four jobs, and a 70B QLoRA."""
    from gpuflex.market.memory import serve_vram_estimate_gb, vram_estimate_gb
    from gpuflex.protocol.spec import ModelSize, TrainingSpec

    llama8 = {"parameters": 8_030_261_248, "layers": 32, "hidden": 4096, "vocab": 128_256}
    llama8 |= {"embeddings": 1_050_673_152, "kv_width": 1024, "dtype": "bf16"}
    llama1 = {"parameters": 1_235_814_400, "trainable": 1_235_814_400, "layers": 16, "hidden": 2048}
    llama1 |= {"vocab": 128_256, "embeddings": 262_668_288, "kv_width": 512, "dtype": "bf16"}
    llama70 = {"parameters": 68_976_648_192, "trainable": 65_536_000, "layers": 80, "hidden": 8192}
    llama70 |= {"vocab": 32_000, "embeddings": 524_288_000, "kv_width": 1024, "dtype": "bf16"}
    smol = {"parameters": 134_515_008, "trainable": 134_515_008, "layers": 30, "hidden": 576}
    smol |= {"vocab": 49_152, "embeddings": 28_311_552, "kv_width": 192, "dtype": "bf16"}

    def job(size: dict, batch: int = 4, block: int = 1024, **fields) -> TrainingSpec:
        model = {"from": "./m", "size": size, "block_size": block}
        base = {"recipe": "hf-causal-lm", "model": model, "precision": "bf16", "batch_size": batch}
        return TrainingSpec.model_validate({**base, "gradient_checkpointing": True, **fields})

    lora8 = {**llama8, "trainable": 13_631_488}
    serve8 = ModelSize.model_validate({**llama8, "trainable": llama8["parameters"]})
    sharded = job(llama70, batch=1, lora=LORA, quantize_base="nf4", local_devices=2, shard=True)
    try:
        serving = serve_vram_estimate_gb(serve8, 4096, 8, "auto")
    except TypeError:  # before the serve estimate took a dtype
        serving = serve_vram_estimate_gb(serve8, 4096, 8)
    rows = {
        "8B LoRA r16 q/k/v/o, bf16, checkpointing, 4 x 1,024": (vram_estimate_gb(job(lora8, lora=LORA)), 22),
        "8B QLoRA (nf4)": (vram_estimate_gb(job(lora8, lora=LORA, quantize_base="nf4")), 12),
        "1.2B full, bf16, checkpointing, 4 x 1,024": (vram_estimate_gb(job(llama1)), 24),
        "135M full, bf16, 8 x 512": (
            vram_estimate_gb(job(smol, batch=8, block=512, gradient_checkpointing=False)),
            3,
        ),
        "serving 8B, context 4,096 x 8": (serving, 24),
        "70B QLoRA over 2 x 24 GB (Llama-2-70B, 1 x 1,024), both devices": (
            2 * (vram_estimate_gb(sharded) or 0),
            48,
        ),
    }
    return {
        name: {"gb": gb, "target_gb": target, "met": gb is not None and gb <= target}
        for name, (gb, target) in rows.items()
    }


if __name__ == "__main__":
    main()
