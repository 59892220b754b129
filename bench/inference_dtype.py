"""Audits of a model served in 16 bits: the figures honest replicas and cheats show, against the thresholds.

    python bench/inference_dtype.py --quick                 # bf16, 96 honest requests, 6 per cheat kind
    python bench/inference_dtype.py                         # bf16, 384 honest requests, 24 per cheat kind
    python bench/inference_dtype.py --model narrow          # the serve tests' shape: 64 wide, 2 layers
    python bench/inference_dtype.py --layers 32 --quick     # a deeper model: bf16's noise grows with depth
    python bench/inference_dtype.py --dtype fp16 --quick    # fp16 on CPU kernels (forced; CUDA serves it)

A replica and its auditor load the same model in the deployment's dtype (``ServedModel.load``), and
``verify`` judges by ``Thresholds.for_dtype``. ``bench/inference.py`` measures float32; this measures the
16-bit dtypes on this machine's CPU, both sides on it. The model is ``inference.MODEL`` (a llama 256 wide)
or ``narrow`` (64 wide and 2 layers, as tests/serve's), saved in float32 and loaded twice in ``--dtype``:
the provider's instance and the verifier's. Honest requests (``inference.make_asks``) are served in groups
by ``inference.PROVERS``' thread counts and batch sizes (left-padded) and verified on their verifier threads;
each cheat of ``inference.CHEAT_KINDS`` on its own requests (``inference.cheat``, one thread).

Every output is verified by ``Thresholds.for_dtype``: its verdict, and its figures (shared top values,
exponent mismatches, mantissa differences; the sampling replay's gaps, near ties within ``tie``).
Reported: honest false positives and each kind's detection rate; the honest figures' worst values and each
kind's closest to passing, for outputs shorter than ``min_mantissa_tokens`` and the rest; the honest near
ties' share of positions and the largest gap of an honest draw. The last stdout line is one JSON object,
kept with the honest outputs that failed in
``bench/results/inference-<dtype>[-narrow][-<n>layers][-quick].json``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import inference
import torch
from prepare import corpus_documents

from gpuflex.serve.model import ServedModel
from gpuflex.serve.verify import Thresholds, verify
from gpuflex.testing import save_llama

MODELS = {"bench": inference.MODEL, "narrow": {**inference.MODEL, "hidden": 64, "layers": 2, "heads": 2}}


def load(model_dir: Path, dtype: str) -> ServedModel:
    """The model as a replica serves it; fp16 with the CPU's kernels, which serving falls back from."""
    if dtype != "fp16":
        return ServedModel.load(model_dir, device="cpu", dtype=dtype)
    served = ServedModel.load(model_dir, device="cpu", dtype="fp32")
    return replace(served, model=served.model.half(), dtype="fp16")


def judged(verifier: ServedModel, ask: inference.Ask, tokens: list[int], fingerprints, threads: int) -> dict:
    """One output's verdict by the dtype's thresholds, and its figures (those of the fingerprints do not
    depend on the thresholds; near ties are the mismatches within ``tie``)."""
    torch.set_num_threads(threads)
    finding = verify(verifier, ask.ids(verifier), tokens, ask.params, fingerprints)
    return {"kind": ask.kind, "ok": finding.ok, "reason": finding.reason, **finding.numbers}


def honest(provider: ServedModel, verifier: ServedModel, asks: list[inference.Ask]) -> list[dict]:
    outputs = []
    group = max(8, len(asks) // (2 * len(inference.PROVERS)))
    for g, start in enumerate(range(0, len(asks), group)):
        threads, batch, verifier_threads = inference.PROVERS[g % len(inference.PROVERS)]
        chunk = asks[start : start + group]
        prompts = [a.ids(provider) for a in chunk]
        params = [a.params for a in chunk]
        served, _ = inference.serve(provider, prompts, params, batch=batch, threads=threads)
        for a, c in zip(chunk, served, strict=True):
            seeded = replace(a, params=replace(a.params, seed=c.params.seed))
            outputs.append(judged(verifier, seeded, list(c.tokens), c.fingerprints, verifier_threads))
        print(f"  honest group {g}: {sum(not o['ok'] for o in outputs)} failed so far", flush=True)
    return outputs


def cheats(provider: ServedModel, verifier: ServedModel, documents: list[str], per_kind: int, seed: int):
    results = {}
    for i, kind in enumerate(inference.CHEAT_KINDS):
        rng = random.Random(seed * 1000 + 17 + i)
        asks = inference.make_asks(rng, documents, per_kind, inference.NEEDS.get(kind))
        tokens, fingerprints, honest_ones = inference.cheat(kind, provider, asks, rng)
        outputs = [
            judged(verifier, a, t, f, 1) | {"identical": list(h.tokens) == t}
            for a, t, f, h in zip(asks, tokens, fingerprints, honest_ones, strict=True)
        ]
        results[kind] = outputs
        print(f"  {kind}: {sum(not o['ok'] for o in outputs)}/{len(outputs)} caught", flush=True)
    return results


def extremes(outputs: list[dict], worst: bool) -> dict:
    """The figures' worst values (honest) or those closest to passing (a cheat), over ``outputs``."""
    if not outputs:
        return {}
    pick = (min, max) if worst else (max, min)  # (shared values, the rest)
    return {
        "outputs": len(outputs),
        "common_min": round(pick[0](o["common_min"] for o in outputs), 4),
        "exponent_mismatch": round(pick[1](o["exponent_mismatch"] for o in outputs), 4),
        "mantissa_mean": round(pick[1](o["mantissa_mean"] for o in outputs), 4),
        "mantissa_max": pick[1](o["mantissa_max"] for o in outputs),
    }


def by_length(outputs: list[dict], short: int, worst: bool) -> dict:
    return {
        f"under_{short}_tokens": extremes([o for o in outputs if o["positions"] < short], worst),
        f"{short}_tokens_or_more": extremes([o for o in outputs if o["positions"] >= short], worst),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--model", choices=list(MODELS), default="bench")
    parser.add_argument("--layers", type=int, help="the model's depth instead of its own")
    parser.add_argument("--quick", action="store_true", help="96 honest requests, 6 per cheat kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    honest_count, per_kind = (96, 6) if args.quick else (384, 24)
    began = time.monotonic()
    documents = corpus_documents("stdlib", inference.TEXT_BYTES)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="gpuflex-dtype-") as saved:
        shape = MODELS[args.model] | ({"layers": args.layers} if args.layers else {})
        model_dir = save_llama(Path(saved) / "model", documents, seed=args.seed, **shape)
        provider, verifier = load(model_dir, args.dtype), load(model_dir, args.dtype)
    thresholds = Thresholds.for_dtype(verifier.dtype, shape["layers"])
    short = thresholds.min_mantissa_tokens

    honest_outputs = honest(provider, verifier, inference.make_asks(rng, documents, honest_count))
    cheat_outputs = cheats(provider, verifier, documents, per_kind, args.seed)
    positions = sum(o["positions"] for o in honest_outputs)
    ties = sum(o["mismatches"] - o["far_mismatches"] for o in honest_outputs)
    caught = {kind: sum(not o["ok"] for o in outputs) for kind, outputs in cheat_outputs.items()}
    summary = {
        "dtype": args.dtype,
        "model": args.model,
        "layers": shape["layers"],
        "thresholds": thresholds.__dict__,
        "honest_outputs": len(honest_outputs),
        "false_positives": sum(not o["ok"] for o in honest_outputs),
        "honest_worst": by_length(honest_outputs, short, worst=True),
        "honest_near_tie_share": round(ties / positions, 4),
        "honest_gap_max_logits": round(max(o["gap_max"] for o in honest_outputs), 4),
        "detection_rate": {k: round(c / len(cheat_outputs[k]), 4) for k, c in caught.items()},
        "detected": f"{sum(caught.values())}/{sum(map(len, cheat_outputs.values()))}",
        "missed": {
            kind: [{"tokens": o["positions"], "identical": o["identical"]} for o in outputs if o["ok"]]
            for kind, outputs in cheat_outputs.items()
            if caught[kind] < len(outputs)
        },
        "cheat_closest": {k: by_length(v, short, worst=False) for k, v in cheat_outputs.items()},
        "wall_s": round(time.monotonic() - began, 1),
    }
    name = "-".join(
        ["inference", args.dtype]
        + ([args.model] if args.model != "bench" else [])
        + ([f"{args.layers}layers"] if args.layers else [])
    )
    out = inference.RESULTS / f"{name}{'-quick' if args.quick else ''}.json"
    failed = [o for o in honest_outputs if not o["ok"]]
    out.write_text(json.dumps({**summary, "honest_failed": failed}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
