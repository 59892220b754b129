"""Inference benchmark: throughput and TTFT direct and through the gateway, failover, the verifier vs cheats.

    .venv/bin/python bench/inference.py --quick   # 64 honest audited requests, 6 per cheat kind
    .venv/bin/python bench/inference.py           # 320 honest audited requests, 30 per cheat kind

Issue 30 names this benchmark: the engine in-process (1, 3 below), the same saved model through the
coordinator's gateway on a local network with failover (``inference_gateway``, 1b), and the verifier (2, 3).

It builds its own model: a byte-level BPE tokenizer trained on the standard library's source and a llama
of 5.2M parameters (4 layers, 256 wide, 4 heads, 2,048 tokens, a context of 512), weights drawn with
``init_std`` 0.1 as the serve tests do (peaked distributions, layers that matter to the hidden states:
``gpuflex.testing.save_llama``), saved to a temporary directory and loaded from it on the CPU by
``ServedModel.load`` in float32 (``inference_dtype.py`` measures 16 bits), twice: the provider's instance
and the verifier's. Requests are mixed: plain prompts (windows of the source text) and chats (a system
and a user message), a few to a few hundred prompt tokens (``honest_lengths`` gives the range served),
greedy and sampled (temperatures 0.6-1.2, top_p 1, 0.95 or 0.9, a stop string now and then), 8 to 128
output tokens; an output ends on EOS, a stop string or ``max_tokens``.

1. **Direct throughput and TTFT** (``Engine`` called in-process, one torch thread, ``max_batch`` 8): the
   same requests served by 1 and by 8 closed-loop streams (a stream submits its next request when its
   last has ended). tokens/s = completion tokens / wall seconds; TTFT = submit to first event.
1b. **Through the gateway** (``inference_gateway``: a coordinator and an agent as processes on loopback,
   the saved model deployed, the official ``openai`` client streaming): the same requests by 1 and by 8
   streams. ``gateway_efficiency`` = gateway tokens/s ÷ direct tokens/s at 8 streams; ``ttft_p50_ms``,
   ``ttft_p99_ms`` at 8 streams; ``added_latency_p50_ms`` = the gateway's TTFT p50 less the direct one at
   one stream (at 8 streams, queueing for a row dominates both; ``added_latency_8_streams_p50_ms``).
   On a shared machine those ratios follow its load; ``cpu_ms_per_token`` does not: the CPU each output
   token cost, direct (this process) and through the gateway (every process, ``gateway_by_process``),
   at 8 streams, and ``gateway_cpu_efficiency`` = direct ÷ gateway (the throughput ratio the gateway
   would reach were the cores all the benchmark's and every one of them busy).
   Then a second agent and replica, 16 long requests by 8 streams, and the first agent killed (``kill
   -9``) once all 8 are under way: ``failover_failed_requests`` (raised, or a text other than the direct
   engine's for that prompt and seed), ``failover_held_requests`` and ``failover_added_latency_ms``.
2. **Honest audited requests**: groups of requests served by the provider's engine with torch threads
   1 or 2 and ``max_batch`` 1, 4 or 8 (a group's requests submitted at once), each output verified
   (``verify.verify``) on the verifier's instance with its own threads (1 or 2).
   ``false_positive_rate`` = outputs failed / outputs verified. ``prover_overhead`` = the engine's
   seconds in fingerprinting (``Fingerprinter.add`` and ``finish``, the engine's ``prove_many``: timed by
   wrapping them) / its wall seconds serving the groups. ``verifier_cost_ratio``: each group's outputs
   are verified a second time on one thread, timed; the verifier's seconds / the provider's wall seconds
   serving them, over the groups the provider served on one thread too (``_by_batch``: per
   ``max_batch``; a batch of 8 serves a request for less, so the ratio is higher). The audit pass's own
   seconds, per request and verifier threads, are reported beside it: on a loaded machine two threads
   can be far slower than one. ``commitment_bytes_per_32_tokens``: the largest fingerprint sent.
3. **Cheats** (``gpuflex.serve.cheats``), each on its own requests; ``detection_rate`` = outputs that fail
   verification / outputs claimed, per kind and overall:
   - ``smaller_model``: the last layer dropped (3 of 4 kept); ``int8``, ``int4``: weights fake-quantized;
   - ``lower_temperature`` (0.7 x asked), ``higher_temperature`` (1.3 x), ``greedy_for_sampled`` on
     sampled requests; ``sampled_for_greedy`` (temperature 1) on greedy ones;
   - tokens the model did not produce: ``random_tokens_fingerprinted`` (random ids, fingerprints made by a
     prefill over them), ``random_tokens_copied_fingerprints`` (the honest output's fingerprints),
     ``spliced_tokens`` (the honest output with its last quarter random, fingerprinted by a prefill),
     ``other_output`` (another request's tokens and fingerprints);
   - ``altered_prompt``: chats served without their system message.
   A cheat whose output equals the honest one token for token (possible for a peaked model) cannot be
   caught by the sampling check (a quantized model's may still be, by its fingerprints):
   ``identical_outputs`` counts them per kind; they stay in ``detection_rate``, and
   ``detection_rate_distinct_outputs`` is over the outputs that differ from the honest one.
   ``margins``: the honest outputs' worst figures against ``verify.Thresholds``, and each kind's
   figures closest to passing.

The last stdout line is one JSON object (``bench/results/inference[-quick].json`` holds it with the
per-group details): the keys above, 95% Clopper-Pearson intervals and ``targets``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import inference_gateway
import torch
from prepare import corpus_documents
from verification import clopper_pearson

from gpuflex.serve import cheats
from gpuflex.serve import engine as engine_module
from gpuflex.serve.engine import Completion, Engine
from gpuflex.serve.fingerprint import Fingerprinter
from gpuflex.serve.model import ServedModel
from gpuflex.serve.sampling import SamplingParams
from gpuflex.serve.verify import Finding, Thresholds, verify
from gpuflex.testing import save_llama

RESULTS = Path(__file__).parent / "results"
MODEL = {"hidden": 256, "layers": 4, "heads": 4, "vocab_size": 2048, "context": 512, "init_std": 0.1}
TEXT_BYTES = 2_000_000  # of the standard library's source: the tokenizer's text and the prompts'
TARGETS = {
    "gateway_efficiency": 0.9,
    "added_latency_p50_ms": 20.0,
    "failover_failed_requests": 0,
    "false_positive_rate": 0.0,
    "honest_audited": 300,
    "verifier_cost_ratio": 0.1,
    "prover_overhead": 0.02,
    "commitment_bytes_per_32_tokens": 258,
}
# (torch threads, max_batch) of the provider's groups, and the verifier's threads for each, in turn
PROVERS = [(1, 1, 2), (1, 4, 1), (2, 8, 1), (2, 1, 1), (1, 8, 2), (2, 4, 2)]
COST_THREADS = 1  # the verifier's cost is timed on as many threads as the provider's groups it is compared to
CHEAT_KINDS = [
    "smaller_model",
    "int8",
    "int4",
    "lower_temperature",
    "higher_temperature",
    "greedy_for_sampled",
    "sampled_for_greedy",
    "random_tokens_fingerprinted",
    "random_tokens_copied_fingerprints",
    "spliced_tokens",
    "other_output",
    "altered_prompt",
]
NEEDS = {  # the requests a kind can cheat on
    "lower_temperature": "sampled",
    "higher_temperature": "sampled",
    "greedy_for_sampled": "sampled",
    "sampled_for_greedy": "greedy",
    "altered_prompt": "chat",
}


@dataclass(frozen=True)
class Mode:
    honest: int  # honest audited requests
    per_cheat: int  # requests per cheat kind
    throughput: int  # requests served by 1 and by 8 streams


QUICK = Mode(honest=64, per_cheat=6, throughput=32)
DEFAULT = Mode(honest=320, per_cheat=30, throughput=96)


@dataclass(frozen=True)
class Ask:
    """A request as a client sends it: a plain prompt or chat messages, and its sampling settings."""

    prompt: str | None
    messages: list[dict] | None
    params: SamplingParams

    def ids(self, served: ServedModel) -> list[int]:
        return served.encode(self.prompt) if self.messages is None else served.encode_chat(self.messages)

    @property
    def kind(self) -> str:
        return ("chat" if self.messages else "plain") + ("/greedy" if self.params.greedy else "/sampled")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], not {q}")
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def rate(hits: int, total: int) -> float | None:
    """hits / total; None when nothing was counted (a rate of nothing is no 0)."""
    if hits < 0 or hits > total:
        raise ValueError(f"{hits} hits of {total}")
    return hits / total if total else None


def make_asks(rng: random.Random, documents: list[str], count: int, need: str | None = None) -> list[Ask]:
    """``count`` mixed requests (``need``: only sampled, greedy or chat ones)."""
    asks = []
    while len(asks) < count:
        chat = need == "chat" or (need is None and rng.random() < 0.5)
        greedy = need == "greedy" or (need not in ("sampled", "greedy") and rng.random() < 0.3)
        params = SamplingParams(
            temperature=0.0 if greedy else rng.choice([0.6, 0.8, 1.0, 1.0, 1.2]),
            top_p=1.0 if greedy else rng.choice([1.0, 1.0, 0.95, 0.9]),
            max_tokens=rng.choice([8, 16, 32, 48, 64, 96, 128]),
            stop=("\n\n",) if rng.random() < 0.15 else (),
            seed=rng.randrange(2**63),
        )
        if chat:
            asks.append(
                Ask(None, [_message(rng, documents, "system"), _message(rng, documents, "user")], params)
            )
        else:
            asks.append(Ask(_window(rng, documents, rng.choice([20, 60, 200, 600, 1000])), None, params))
    return asks


def _window(rng: random.Random, documents: list[str], chars: int) -> str:
    doc = rng.choice(documents)
    start = rng.randrange(max(1, len(doc) - chars))
    return doc[start : start + chars].strip() or "def"


def _message(rng: random.Random, documents: list[str], role: str) -> dict:
    return {"role": role, "content": _window(rng, documents, rng.choice([20, 80, 300]))}


# ---------------------------------------------------------------------------------------------- timing


class FingerprintClock:
    """While entered, the engine's fingerprinting calls are timed (seconds summed, the outermost call
    only: ``finish`` calls ``prove_many`` itself)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds += time.perf_counter() - started

        return timed

    def __enter__(self) -> FingerprintClock:
        self._saved = (engine_module.prove_many, Fingerprinter.add, Fingerprinter.finish)
        engine_module.prove_many = self._timed(engine_module.prove_many)
        Fingerprinter.add = self._timed(Fingerprinter.add)
        Fingerprinter.finish = self._timed(Fingerprinter.finish)
        return self

    def __exit__(self, *exc) -> None:
        engine_module.prove_many, Fingerprinter.add, Fingerprinter.finish = self._saved


def serve(
    served: ServedModel, prompts: list[list[int]], params: list[SamplingParams], *, batch: int, threads: int
):
    """Each prompt's completion, all submitted at once to a fresh engine: (completions, wall seconds)."""
    torch.set_num_threads(threads)  # the engine's thread takes the count set when it first computes
    with Engine(served, max_batch=batch) as engine:
        started = time.perf_counter()
        requests = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        completions = [r.result(timeout=600) for r in requests]
        wall = time.perf_counter() - started
    return completions, wall


# ------------------------------------------------------------------------------------- 1. throughput


def streams(served: ServedModel, prompts: list[list[int]], params: list[SamplingParams], count: int) -> dict:
    """The requests served by ``count`` closed-loop streams: tokens/s and each request's TTFT."""
    torch.set_num_threads(1)
    work = list(zip(prompts, params, strict=True))
    lock = threading.Lock()
    ttfts: list[float] = []
    tokens = [0]
    errors: list[BaseException] = []

    def stream(engine: Engine) -> None:
        while True:
            with lock:
                if not work:
                    return
                prompt, p = work.pop(0)
            try:
                submitted = time.perf_counter()
                request = engine.submit(prompt, p)
                first = None
                for _ in request.events(timeout=600):
                    first = first or time.perf_counter()
                with lock:
                    ttfts.append(first - submitted)
                    tokens[0] += request.result().usage.completion_tokens
            except BaseException as err:  # reported by the main thread
                errors.append(err)
                return

    with Engine(served, max_batch=8) as engine:
        started, cpu = time.perf_counter(), sum(os.times()[:2])
        workers = [threading.Thread(target=stream, args=(engine,)) for _ in range(count)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall, cpu = time.perf_counter() - started, sum(os.times()[:2]) - cpu
    if errors:
        raise errors[0]
    ms = [t * 1000 for t in ttfts]
    return {
        "streams": count,
        "requests": len(ttfts),
        "tokens": tokens[0],
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens[0] / wall, 1),
        "ttft_p50_ms": round(percentile(ms, 50), 1),
        "ttft_p99_ms": round(percentile(ms, 99), 1),
        "ttft_max_ms": round(max(ms), 1),
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_token": round(cpu / tokens[0] * 1000, 3),
    }


# ----------------------------------------------------------------------------------- 2. honest audits


@dataclass
class Honest:
    requests: int = 0
    failed: list[dict] = field(default_factory=list)
    generate_s: float = 0.0
    fingerprint_s: float = 0.0
    verify_s: float = 0.0
    disagreements: int = 0  # outputs the cost pass judged otherwise than the audit
    tokens: int = 0
    commitment_bytes: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)


WORST = {  # each honest figure's worse direction: max or min over the outputs
    "common_min": min,
    "exponent_mismatch": max,
    "mantissa_mean": max,
    "mantissa_max": max,
    "mismatch_share": max,
    "gap_max": max,
}


def audit_honest(provider: ServedModel, verifier: ServedModel, asks: list[Ask]) -> Honest:
    tally = Honest()
    group = max(8, len(asks) // (2 * len(PROVERS)))  # each config serves two groups (one in --quick)
    for g, start in enumerate(range(0, len(asks), group)):
        threads, batch, verifier_threads = PROVERS[g % len(PROVERS)]
        chunk = asks[start : start + group]
        prompts = [a.ids(provider) for a in chunk]
        with FingerprintClock() as clock:
            completions, wall = serve(
                provider, prompts, [a.params for a in chunk], batch=batch, threads=threads
            )
        findings, verify_s = verify_each(verifier, chunk, completions, verifier_threads)
        # the cost pass: the same outputs verified again on COST_THREADS threads, timed (and judged alike)
        again, cost_s = verify_each(verifier, chunk, completions, COST_THREADS)
        tally.disagreements += sum(f.ok != g.ok for f, g in zip(findings, again, strict=True))
        tally.requests += len(chunk)
        tally.generate_s += wall
        tally.fingerprint_s += clock.seconds
        tally.verify_s += verify_s
        tokens = sum(len(c.tokens) for c in completions)
        tally.tokens += tokens
        tally.prompt_tokens += [len(p) for p in prompts]
        tally.output_tokens += [len(c.tokens) for c in completions]
        tally.commitment_bytes = max(
            [tally.commitment_bytes, *(len(f) for c in completions for f in c.fingerprints)]
        )
        for a, f in zip(chunk, findings, strict=True):
            tally.kinds[a.kind] = tally.kinds.get(a.kind, 0) + 1
            if not f.ok:
                tally.failed.append(
                    {"kind": a.kind, "threads": threads, "batch": batch, "reason": f.reason, **f.numbers}
                )
            for name, worse in WORST.items():
                value = (
                    f.numbers["mismatches"] / f.numbers["positions"]
                    if name == "mismatch_share"
                    else f.numbers[name]
                )
                if name == "gap_max" and not f.numbers["mismatches"]:
                    continue  # gap_max is 0 where every draw agreed
                tally.worst[name] = worse(tally.worst.get(name, value), value)
        tally.groups.append(
            {
                "prover_threads": threads,
                "max_batch": batch,
                "verifier_threads": verifier_threads,
                "requests": len(chunk),
                "tokens": tokens,
                "generate_s": round(wall, 3),
                "fingerprint_s": round(clock.seconds, 3),
                "verify_s": round(verify_s, 3),
                f"verify_s_{COST_THREADS}_thread": round(cost_s, 3),
                "failed": sum(not f.ok for f in findings),
            }
        )
        print(f"  honest group {g}: {json.dumps(tally.groups[-1])}", flush=True)
    return tally


# ------------------------------------------------------------------------------------------ 3. cheats


def cheat(
    kind: str, provider: ServedModel, asks: list[Ask], rng: random.Random
) -> tuple[list[list[int]], list[tuple[bytes, ...]], list[Completion]]:
    """The outputs (tokens, fingerprints) a provider cheating by ``kind`` claims for ``asks``, and the
    honest completions of the same requests."""
    prompts = [a.ids(provider) for a in asks]
    params = [a.params for a in asks]
    honest, _ = serve(provider, prompts, params, batch=8, threads=1)
    vocab = provider.model.get_input_embeddings().num_embeddings
    if kind in ("smaller_model", "int8", "int4"):
        layers = provider.model.config.num_hidden_layers
        model = {
            "smaller_model": lambda: cheats.drop_layers(provider, layers - 1),
            "int8": lambda: cheats.quantize(provider, 8),
            "int4": lambda: cheats.quantize(provider, 4),
        }[kind]()
        claims, _ = serve(model, prompts, params, batch=8, threads=1)
        return [list(c.tokens) for c in claims], [c.fingerprints for c in claims], honest
    if kind in ("lower_temperature", "higher_temperature", "greedy_for_sampled", "sampled_for_greedy"):
        served_as = {
            "lower_temperature": lambda p: replace(p, temperature=0.7 * p.temperature),
            "higher_temperature": lambda p: replace(p, temperature=min(2.0, 1.3 * p.temperature)),
            "greedy_for_sampled": lambda p: replace(p, temperature=0.0),
            "sampled_for_greedy": lambda p: replace(p, temperature=1.0),
        }[kind]
        claims, _ = serve(provider, prompts, [served_as(p) for p in params], batch=8, threads=1)
        return [list(c.tokens) for c in claims], [c.fingerprints for c in claims], honest
    if kind == "altered_prompt":
        altered = [provider.encode_chat(cheats.drop_system(a.messages)) for a in asks]
        claims, _ = serve(provider, altered, params, batch=8, threads=1)
        return [list(c.tokens) for c in claims], [c.fingerprints for c in claims], honest
    if kind == "other_output":
        rotated = honest[1:] + honest[:1]
        return [list(c.tokens) for c in rotated], [c.fingerprints for c in rotated], honest
    tokens = []
    for c in honest:
        if kind == "spliced_tokens":
            keep = len(c.tokens) - max(1, len(c.tokens) // 4)
            tokens.append(list(c.tokens[:keep]) + [rng.randrange(vocab) for _ in c.tokens[keep:]])
        else:
            tokens.append([rng.randrange(vocab) for _ in c.tokens])
    if kind == "random_tokens_copied_fingerprints":
        return tokens, [c.fingerprints for c in honest], honest
    fingerprints = [cheats.refingerprint(provider, p, t) for p, t in zip(prompts, tokens, strict=True)]
    return tokens, fingerprints, honest


def verify_each(
    verifier: ServedModel, asks: list[Ask], completions: list, threads: int
) -> tuple[list[Finding], float]:
    """Every output verified on ``threads`` torch threads, and the seconds it took."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    findings = [
        verify(
            verifier, a.ids(verifier), list(c.tokens), replace(a.params, seed=c.params.seed), c.fingerprints
        )
        for a, c in zip(asks, completions, strict=True)
    ]
    return findings, time.perf_counter() - started


def audit_cheats(
    provider: ServedModel, verifier: ServedModel, documents: list[str], per_kind: int, seed: int
) -> dict:
    results = {}
    for i, kind in enumerate(CHEAT_KINDS):
        rng = random.Random(seed * 1000 + 17 + i)
        asks = make_asks(rng, documents, per_kind, NEEDS.get(kind))
        started = time.perf_counter()
        tokens, fingerprints, honest = cheat(kind, provider, asks, rng)
        torch.set_num_threads(1)
        findings: list[Finding] = [
            verify(verifier, a.ids(verifier), t, a.params, f)
            for a, t, f in zip(asks, tokens, fingerprints, strict=True)
        ]
        caught = sum(not f.ok for f in findings)
        passed = [f for f in findings if f.ok]
        identical = [list(h.tokens) == t for h, t in zip(honest, tokens, strict=True)]
        results[kind] = {
            "caught": caught,
            "total": len(findings),
            "identical_outputs": sum(identical),
            "distinct": identical.count(False),
            "caught_distinct": sum(not f.ok for f, same in zip(findings, identical, strict=True) if not same),
            "reasons": _reasons(findings),
            "closest": _closest(findings),
            "passed": [f.numbers for f in passed],
            "wall_s": round(time.perf_counter() - started, 1),
        }
        print(f"  {kind}: {caught}/{len(findings)} caught  {results[kind]['reasons']}", flush=True)
    return results


def cost_ratios(groups: list[dict]) -> tuple[float, dict[str, float]]:
    """The verifier's seconds on ``COST_THREADS`` threads over the provider's wall seconds, over the groups
    the provider served on as many threads: overall and per ``max_batch``."""
    same = [g for g in groups if g["prover_threads"] == COST_THREADS]
    key = f"verify_s_{COST_THREADS}_thread"

    def ratio(of: list[dict]) -> float:
        return sum(g[key] for g in of) / sum(g["generate_s"] for g in of)

    by_batch = {
        str(b): round(ratio([g for g in same if g["max_batch"] == b]), 4)
        for b in sorted({g["max_batch"] for g in same})
    }
    return ratio(same), by_batch


def _reasons(findings: list[Finding]) -> dict[str, int]:
    """The failing checks, counted: fingerprint (top values, exponents, mantissas) or sampling."""
    counts: dict[str, int] = {}
    for f in findings:
        if f.ok:
            continue
        check = (
            "fingerprint_top_values"
            if "top values" in f.reason
            else "fingerprint_exponent"
            if "exponent" in f.reason
            else "fingerprint_mantissa"
            if "hidden states" in f.reason
            else "sampling"
            if "tokens" in f.reason
            else f.reason
        )
        counts[check] = counts.get(check, 0) + 1
    return counts


def _closest(findings: list[Finding]) -> dict[str, float]:
    """Of a kind's outputs, the figures nearest the honest side (each taken over all of them)."""
    numbers = [f.numbers for f in findings if f.numbers]
    if not numbers:
        return {}
    return {
        "common_min": round(max(n["common_min"] for n in numbers), 4),
        "mantissa_mean": round(min(n["mantissa_mean"] for n in numbers), 4),
        "far_mismatches": min(n["far_mismatches"] for n in numbers),
    }


# -------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests: under 6 minutes on 2 cores")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mode = QUICK if args.quick else DEFAULT
    began, load_before = time.monotonic(), os.getloadavg()
    torch.set_num_threads(1)
    documents = corpus_documents("stdlib", TEXT_BYTES)
    rng = random.Random(args.seed)
    saved = tempfile.TemporaryDirectory(prefix="gpuflex-inference-")  # kept for the gateway's agents
    model_dir = save_llama(Path(saved.name) / "model", documents, seed=args.seed, **MODEL)
    provider = ServedModel.load(model_dir, device="cpu", dtype="fp32")
    verifier = ServedModel.load(model_dir, device="cpu", dtype="fp32")  # the verifier's own instance
    parameters = sum(p.numel() for p in provider.model.parameters())
    print(f"model: {parameters:,} parameters, {len(documents):,} documents", flush=True)

    asks = make_asks(rng, documents, mode.throughput)
    prompts, params = [a.ids(provider) for a in asks], [a.params for a in asks]
    direct = {f"{n}_streams": streams(provider, prompts, params, n) for n in (1, 8)}
    for figures in direct.values():
        print(f"  direct: {json.dumps(figures)}", flush=True)
    failover_prompts, failover_params = inference_gateway.failover_work(prompts, params)
    expected, _ = serve(provider, failover_prompts, failover_params, batch=8, threads=1)
    expected = {"prompts": failover_prompts, "params": failover_params, "texts": [c.text for c in expected]}
    with saved:
        gateway = inference_gateway.measure(model_dir, prompts, params, expected)

    honest = audit_honest(provider, verifier, make_asks(rng, documents, mode.honest))
    cheated = audit_cheats(provider, verifier, documents, mode.per_cheat, args.seed)

    summary = _summary(args, mode, parameters, direct, gateway, honest, cheated)
    summary["wall_s"] = round(time.monotonic() - began, 1)
    summary["load_average"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("inference-quick.json" if args.quick else "inference.json")
    details = {
        "direct": direct,
        "gateway": gateway,
        "honest_groups": honest.groups,
        "honest_failed": honest.failed,
        "cheats": cheated,
    }
    out.write_text(json.dumps({**summary, "details": details}, indent=1))
    print(json.dumps(summary))


def _summary(
    args, mode: Mode, parameters: int, direct: dict, gateway: dict, honest: Honest, cheated: dict
) -> dict:
    caught = sum(c["caught"] for c in cheated.values())
    total = sum(c["total"] for c in cheated.values())
    false_positives = len(honest.failed)
    fpr = rate(false_positives, honest.requests)
    verifier_cost, cost_by_batch = cost_ratios(honest.groups)
    per_request = {
        t: round(
            sum(g["verify_s"] for g in honest.groups if g["verifier_threads"] == t)
            / max(1, sum(g["requests"] for g in honest.groups if g["verifier_threads"] == t)),
            4,
        )
        for t in sorted({g["verifier_threads"] for g in honest.groups})
    }
    overhead = honest.fingerprint_s / honest.generate_s
    overhead_by_batch = {
        str(b): round(
            sum(g["fingerprint_s"] for g in honest.groups if g["max_batch"] == b)
            / sum(g["generate_s"] for g in honest.groups if g["max_batch"] == b),
            4,
        )
        for b in sorted({g["max_batch"] for g in honest.groups})
    }
    thresholds = asdict(Thresholds())
    efficiency = gateway["8_streams"]["tokens_per_s"] / direct["8_streams"]["tokens_per_s"]
    added = gateway["1_streams"]["ttft_p50_ms"] - direct["1_streams"]["ttft_p50_ms"]
    failover = gateway["failover"]
    return {
        "direct_tokens_per_s": direct["8_streams"]["tokens_per_s"],
        "direct_tokens_per_s_1_stream": direct["1_streams"]["tokens_per_s"],
        "gateway_tokens_per_s": gateway["8_streams"]["tokens_per_s"],
        "gateway_efficiency": round(efficiency, 3),
        "direct_ttft_p50_ms": direct["8_streams"]["ttft_p50_ms"],
        "direct_ttft_p99_ms": direct["8_streams"]["ttft_p99_ms"],
        "direct_ttft_1_stream_p50_ms": direct["1_streams"]["ttft_p50_ms"],
        "direct_ttft_1_stream_p99_ms": direct["1_streams"]["ttft_p99_ms"],
        "ttft_p50_ms": gateway["8_streams"]["ttft_p50_ms"],
        "ttft_p99_ms": gateway["8_streams"]["ttft_p99_ms"],
        "ttft_1_stream_p50_ms": gateway["1_streams"]["ttft_p50_ms"],
        "added_latency_p50_ms": round(added, 1),
        "added_latency_8_streams_p50_ms": round(
            gateway["8_streams"]["ttft_p50_ms"] - direct["8_streams"]["ttft_p50_ms"], 1
        ),
        "cpu_ms_per_token": {
            "direct": direct["8_streams"]["cpu_ms_per_token"],
            "gateway": gateway["8_streams"]["cpu_ms_per_token"],
            "gateway_by_process": {
                name: round(seconds / gateway["8_streams"]["tokens"] * 1000, 3)
                for name, seconds in gateway["8_streams"]["cpu_s"].items()
            },
        },
        "gateway_cpu_efficiency": round(
            direct["8_streams"]["cpu_ms_per_token"] / gateway["8_streams"]["cpu_ms_per_token"], 3
        ),
        "failover_failed_requests": failover["failed"],
        "failover_requests": failover["requests"],
        "failover_held_requests": failover["held"],
        "failover_added_latency_ms": {
            "held_max": max(failover["held_added_latency_ms"], default=None),
            "held_p50": round(percentile(failover["held_added_latency_ms"], 50), 1)
            if failover["held_added_latency_ms"]
            else None,
            "others_max": failover["others_added_latency_max_ms"],
        },
        "detection_rate": {
            "overall": round(rate(caught, total), 4),
            **{kind: round(rate(c["caught"], c["total"]), 4) for kind, c in cheated.items()},
        },
        "detection_ci95": clopper_pearson(caught, total),
        "cheat_outputs": total,
        "identical_outputs": {
            k: c["identical_outputs"] for k, c in cheated.items() if c["identical_outputs"]
        },
        "detection_rate_distinct_outputs": round(
            rate(
                sum(c["caught_distinct"] for c in cheated.values()),
                sum(c["distinct"] for c in cheated.values()),
            ),
            4,
        ),
        "caught_by": {k: c["reasons"] for k, c in cheated.items()},
        "false_positive_rate": fpr,
        "false_positive_ci95": clopper_pearson(false_positives, honest.requests),
        "honest_audited": honest.requests,
        "honest_mix": dict(sorted(honest.kinds.items())),
        "honest_lengths": {
            name: {"min": min(n), "median": percentile(n, 50), "max": max(n)}
            for name, n in (("prompt_tokens", honest.prompt_tokens), ("output_tokens", honest.output_tokens))
        },
        "verifier_cost_ratio": round(verifier_cost, 4),
        "verifier_cost_ratio_by_batch": cost_by_batch,
        "verify_s_per_request_by_verifier_threads": per_request,
        "cost_pass_disagreements": honest.disagreements,
        "prover_overhead": round(overhead, 4),
        "prover_overhead_by_batch": overhead_by_batch,
        "commitment_bytes_per_32_tokens": honest.commitment_bytes,
        "margins": {
            "honest_worst": {k: round(v, 4) for k, v in honest.worst.items()},
            "thresholds": thresholds,
            "cheats_closest": {k: c["closest"] for k, c in cheated.items()},
        },
        "targets": {
            "gateway_efficiency": efficiency >= TARGETS["gateway_efficiency"],
            "added_latency_p50_ms": added <= TARGETS["added_latency_p50_ms"],
            "failover_failed_requests": failover["failed"] == TARGETS["failover_failed_requests"],
            "false_positive_rate": fpr == TARGETS["false_positive_rate"],
            "honest_audited": honest.requests >= TARGETS["honest_audited"],
            "verifier_cost_ratio": verifier_cost <= TARGETS["verifier_cost_ratio"],
            "prover_overhead": overhead <= TARGETS["prover_overhead"],
            "commitment_bytes_per_32_tokens": honest.commitment_bytes
            <= TARGETS["commitment_bytes_per_32_tokens"],
        },
        "honest_tokens": honest.tokens,
        "generate_s": round(honest.generate_s, 2),
        "fingerprint_s": round(honest.fingerprint_s, 3),
        "verify_s": round(honest.verify_s, 2),
        "parameters": parameters,
        "cores": os.cpu_count(),
        "settings": {
            "mode": "quick" if args.quick else "default",
            "seed": args.seed,
            "model": MODEL,
            "honest_requests": mode.honest,
            "requests_per_cheat": mode.per_cheat,
            "throughput_requests": mode.throughput,
            "provers": [{"threads": t, "max_batch": b, "verifier_threads": v} for t, b, v in PROVERS],
        },
    }


if __name__ == "__main__":
    sys.exit(main())
