"""Honest replicas on different devices agree, and cheats are still caught: the verifier across CPU and CUDA.

    python bench/inference_devices.py --quick   # on a machine with a CUDA GPU: 48 honest requests a pair
    python bench/inference_devices.py           # 192 honest requests a pair, 12 per cheat kind

Issue 30 asks for a tolerance under which honest replicas on different thread counts, batch sizes *and
devices* agree. ``bench/inference.py`` measures the first two on the CPU; this adds the device. The same
saved model (``bench/inference.py``'s: a llama of 5.2M parameters in float32, built here) is loaded on the
CPU and on CUDA, and ``inference.audit_honest`` serves honest requests on one device (its groups' thread
counts and batch sizes, as in that bench) and verifies each output on the other, with the default
``verify.Thresholds``:

- ``cuda->cpu``: a GPU provider audited by a CPU verifier;
- ``cpu->cuda``: a CPU provider audited by a GPU verifier;
- ``cuda->cuda``: both on the GPU (different batch sizes only).

Each pair reports its false positives and the honest figures' worst values (``inference.WORST``) against
the thresholds. Then the cheats of ``inference.CHEAT_KINDS``, produced on CUDA and verified on the CPU
(``inference.audit_cheats``): what a CPU core node sees of a GPU cheater. Last, the engine's tokens/s and
TTFT on CUDA by 1 and 8 streams (``inference.streams``), beside the CPU's on this machine, and the
verifier's seconds per audited request over the provider's (``verifier_cost_ratio``) on CUDA.

The last stdout line is one JSON object; ``bench/results/inference-devices[-quick].json`` holds it with
the per-group details. CUDA matmuls run in full float32 (PyTorch's default: TF32 off).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import inference
import torch
from prepare import corpus_documents

from gpuflex.serve.model import ServedModel
from gpuflex.serve.verify import Thresholds
from gpuflex.testing import save_llama

PAIRS = [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="48 honest requests a pair, 4 per cheat kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("inference_devices needs a CUDA device: run it on a GPU machine")
    honest_count, per_cheat = (48, 4) if args.quick else (192, 12)
    began = time.monotonic()
    documents = corpus_documents("stdlib", inference.TEXT_BYTES)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="gpuflex-devices-") as saved:
        model_dir = save_llama(Path(saved) / "model", documents, seed=args.seed, **inference.MODEL)
        devices = ("cpu", "cuda")
        loaded = {device: ServedModel.load(model_dir, device=device, dtype="fp32") for device in devices}
        verifiers = {device: ServedModel.load(model_dir, device=device, dtype="fp32") for device in devices}

    pairs = {}
    for prover, verifier in PAIRS:
        honest = inference.audit_honest(
            loaded[prover], verifiers[verifier], inference.make_asks(rng, documents, honest_count)
        )
        pairs[f"{prover}->{verifier}"] = {
            "requests": honest.requests,
            "false_positives": len(honest.failed),
            "failed": honest.failed,
            "worst": {k: round(v, 4) for k, v in honest.worst.items()},
            "generate_s": round(honest.generate_s, 2),
            "verify_s": round(honest.verify_s, 2),
            "verifier_cost_ratio": round(honest.verify_s / honest.generate_s, 4),
        }
        shown = {k: v for k, v in pairs[f"{prover}->{verifier}"].items() if k != "failed"}
        print(f"{prover}->{verifier}: {json.dumps(shown)}", flush=True)

    cheats = inference.audit_cheats(loaded["cuda"], verifiers["cpu"], documents, per_cheat, args.seed)
    caught = sum(c["caught"] for c in cheats.values())
    claimed = sum(c["total"] for c in cheats.values())

    asks = inference.make_asks(rng, documents, 32)
    throughput = {}
    for device in ("cpu", "cuda"):
        prompts, params = [a.ids(loaded[device]) for a in asks], [a.params for a in asks]
        throughput[device] = {
            f"{n}_streams": inference.streams(loaded[device], prompts, params, n) for n in (1, 8)
        }
        print(f"throughput {device}: {json.dumps(throughput[device])}", flush=True)

    verified = sum(p["requests"] for p in pairs.values())
    summary = {
        "bench": "inference_devices",
        "quick": args.quick,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "thresholds": Thresholds().__dict__,
        "honest_verified": verified,
        "false_positives": sum(p["false_positives"] for p in pairs.values()),
        "pairs": {k: {n: v for n, v in p.items() if n != "failed"} for k, p in pairs.items()},
        "cheats_caught": caught,
        "cheats_claimed": claimed,
        "detection_rate": round(caught / claimed, 4),
        "detection_by_kind": {k: f"{c['caught']}/{c['total']}" for k, c in cheats.items()},
        "cuda_tokens_per_s_8_streams": throughput["cuda"]["8_streams"]["tokens_per_s"],
        "cpu_tokens_per_s_8_streams": throughput["cpu"]["8_streams"]["tokens_per_s"],
        "cuda_ttft_p50_ms_1_stream": throughput["cuda"]["1_streams"]["ttft_p50_ms"],
        "wall_s": round(time.monotonic() - began, 1),
    }
    inference.RESULTS.mkdir(parents=True, exist_ok=True)
    out = inference.RESULTS / ("inference-devices-quick.json" if args.quick else "inference-devices.json")
    details = {"pairs": pairs, "cheats": cheats, "throughput": throughput}
    out.write_text(json.dumps({**summary, "details": details}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
