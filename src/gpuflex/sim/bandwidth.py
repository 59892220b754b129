"""The aggregator bandwidth a model size needs, from the compression ratios ``bench/diloco_vs_ddp.py``
measured.

That benchmark writes ``bench/results/diloco_vs_ddp.json``: for each DiLoCo config, the bytes one
worker sent and received over the whole run (``configs[].bytes_per_worker``: headers, indices, JSON
and its joining checkpoint included), for a model whose shape is in ``settings.model``, trained for
``settings.steps_per_worker`` steps in rounds of ``settings.configs[].inner_steps``. Divided by the
parameters (``market.pricing.parameter_count``) and the rounds, that is the measured *bytes per
parameter per round* one worker moves, both ways. An aggregator serving ``W`` workers moves ``W``
times that per round, so a model of ``P`` parameters with rounds of ``T`` seconds needs

    W x bytes_per_parameter_round x P / T    bytes per second (in and out together)

at the aggregator, for the round's exchange to take no longer than the round itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpuflex.errors import SpecError
from gpuflex.market.pricing import parameter_count
from gpuflex.protocol.spec import TrainingSpec

# the checkout's own results, wherever ``gpuflex sim`` runs from (an installed package has none)
DEFAULT_RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results" / "diloco_vs_ddp.json"


@dataclass(frozen=True)
class Codec:
    name: str
    bytes_per_parameter_round: float  # one worker, up and down, as measured
    loss_gap: float | None  # the config's validation loss over DDP's, minus one


def measured_codecs(path: Path = DEFAULT_RESULTS) -> list[Codec]:
    """The DiLoCo configs of a ``diloco_vs_ddp.py`` result file; SpecError when it can't be read."""
    try:
        result = json.loads(path.read_text())
        settings = result["settings"]
        params = parameter_count(TrainingSpec.model_validate({"model": settings["model"]}))
        steps = settings["steps_per_worker"]
        inner = {c["name"]: c["inner_steps"] for c in settings["configs"]}
        return [
            Codec(
                c["name"],
                c["bytes_per_worker"] / (params * steps / inner[c["name"]]),
                c.get("loss_gap"),
            )
            for c in result["configs"]
            if c["name"] in inner
        ]
    except OSError as err:
        raise SpecError(f"cannot read the benchmark results {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as err:
        raise SpecError(f"{path} is not a diloco_vs_ddp.py result: {err!r}") from None


def aggregator_bytes_per_s(codec: Codec, params: float, workers: int, round_s: float) -> float:
    """Bytes per second (both ways) an aggregator needs for ``workers`` workers of a ``params`` model."""
    return workers * codec.bytes_per_parameter_round * params / round_s


def table(codecs: list[Codec], sizes: list[float], workers: int, round_s: float) -> list[dict]:
    """One row per codec and model size, in Gbit/s."""
    return [
        {
            "codec": c.name,
            "loss_gap": c.loss_gap,
            "bytes_per_parameter_round": c.bytes_per_parameter_round,
            "params": size,
            "workers": workers,
            "round_s": round_s,
            "gbit_per_s": aggregator_bytes_per_s(c, size, workers, round_s) * 8 / 1e9,
        }
        for c in codecs
        for size in sizes
    ]
