"""How often a quote's range holds what the job then took: calibrated quotes against the pricing model's
own, over a set of real jobs on one local network.

    python bench/quotes.py            # 12 jobs
    python bench/quotes.py --quick    # 8 jobs: under 6 minutes on 2 cores

A coordinator (SQLite), one core agent and two community agents, real processes training for real (no
emulated devices: the nodes' benchmarked TFLOPS are what the quote knows of them). The jobs differ in
model width, rounds, inner steps, workers and pacing (one is time-budgeted), and run one after
another. Before each, the bench asks the coordinator for a quote (calibrated on the jobs completed so
far, ``market.calibration``) and prices the same spec on the same offers with no history (the model's
constants alone). Each job's actual duration is submitted to finished, read from the coordinator's
database; its actual cost, what it spent.

Reported: ``in_range`` (the share of jobs whose actual duration fell inside the quote's range; for the
calibrated quotes, over the jobs quoted after ``MIN_JOBS`` had completed, as the first ones are quoted
on the prior), ``cost_in_range`` likewise, ``median_error`` (the median of |actual / expected - 1|) and
``range_width`` (the median of high / low: a range wide enough holds anything). It writes
``bench/results/quotes[-quick].json`` and prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select

from gpuflex.cli.inputs import upload_inputs
from gpuflex.client import Client
from gpuflex.coordinator.db import Job, make_engine, make_sessionmaker
from gpuflex.localnet import CORE_TOKEN, LocalNetwork
from gpuflex.market.calibration import MIN_JOBS
from gpuflex.market.matching import NodeOffer
from gpuflex.market.quotes import quote
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import wait_for

RESULTS = Path(__file__).parent / "results"
# (width, rounds, inner steps, workers, round seconds): interleaved, so that each kind of job is quoted
# on a history of the others
JOBS = [
    (32, 3, 20, 1, None),
    (64, 2, 30, 2, None),
    (96, 3, 20, 1, None),
    (32, 4, 40, 2, None),
    (64, 3, 10_000, 1, 3.0),
    (96, 2, 40, 2, None),
    (32, 2, 60, 1, None),
    (64, 4, 20, 2, None),
    (96, 4, 30, 1, None),
    (32, 3, 10_000, 2, 4.0),
    (64, 5, 20, 1, None),
    (96, 3, 40, 2, None),
]
QUICK_JOBS = 8


def job_spec(width: int, rounds: int, steps: int, workers: int, round_s: float | None) -> JobSpec:
    training = {
        "rounds": rounds,
        "inner_steps": steps,
        "batch_size": 16,
        "compression": "int8",
        "eval_batches": 8,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": width, "block_size": 64},
    }
    if round_s is not None:
        training["round_seconds"] = round_s
    return JobSpec.model_validate(
        {
            "name": f"quoted-{width}x{rounds}x{steps}",
            "resources": {"workers": workers},
            "training": training,
            "data": {"source": "stdlib", "max_bytes": 500_000},
            "budget": 5.0,
            "max_price_per_hour": 1.0,
        }
    )


@dataclass
class Quoted:
    job: str
    workers: int
    time_budgeted: bool
    actual_s: float
    calibrated: tuple[float, float, float]  # low, expected, high seconds
    uncalibrated: tuple[float, float, float]
    calibrated_on: int  # completed jobs before it
    spent: float
    cost: tuple[float, float, float]
    uncalibrated_cost: tuple[float, float, float]


def _node_offers(client: Client) -> list[NodeOffer]:
    """The market's online offers as the pricing model takes them."""
    return [
        NodeOffer(
            o.node_id, o.name, o.kind, o.price_per_hour, o.tflops, o.vram_gb, (), o.region, o.reliability or 1
        )
        for o in client.offers()
        if o.state == "online"
    ]


def run(jobs: list[tuple], root: Path) -> list[Quoted]:
    net = LocalNetwork(root)
    try:
        url = net.start_coordinator()
        net.start_agent("core0", price=0.4, core=True, extra=["--core-token", CORE_TOKEN])
        for i in range(2):
            net.start_agent(f"c{i}", price=0.1 + i / 100)
        client = Client(url, Client(url).create_account("bench").token, retry_for_s=60)
        client.deposit(100)
        wait_for(
            lambda: sum(o.state == "online" for o in client.offers()) == 3, 120, "the agents to register"
        )
        sessions = make_sessionmaker(make_engine(net.database))
        out: list[Quoted] = []
        for i, shape in enumerate(jobs):
            spec = job_spec(*shape)
            q = client.quote(spec)
            model = quote(spec, _node_offers(client))
            job_id = client.submit(spec, **upload_inputs(client, spec)).id
            done = wait_for(lambda job_id=job_id: _ended(client, job_id), 900, "the job to end")
            with sessions() as s:
                row = s.scalar(select(Job).where(Job.id == job_id))
                actual = row.finished_at - row.created_at
            out.append(
                Quoted(
                    job=spec.name,
                    workers=shape[3],
                    time_budgeted=shape[4] is not None,
                    actual_s=round(actual, 1),
                    calibrated=(q.duration_low_s, q.duration_s, q.duration_high_s),
                    uncalibrated=(model.duration_low_s, model.duration_s, model.duration_high_s),
                    calibrated_on=i,
                    spent=done.spent,
                    cost=(q.cost_low, q.cost, q.cost_high),
                    uncalibrated_cost=(model.cost_low, model.cost, model.cost_high),
                )
            )
            print(_line(out[-1], done.state), file=sys.stderr, flush=True)
            time.sleep(1)  # the nodes' leases end with the job; let them take the next one fresh
        return out
    finally:
        net.stop()


def _ended(client: Client, job_id: str):
    job = client.job(job_id)
    return job if job.state in ("completed", "failed", "cancelled", "out_of_budget") else None


def _line(r: Quoted, state: str) -> str:
    low, mid, high = r.calibrated
    m_low, m_mid, m_high = r.uncalibrated
    return (
        f"{r.job} ({r.workers} workers, {state}): took {r.actual_s:.1f} s; quoted {mid:.1f} "
        f"({low:.1f}-{high:.1f}) after {r.calibrated_on} jobs, the model alone {m_mid:.1f} "
        f"({m_low:.1f}-{m_high:.1f}); spent {r.spent:.5f} of {r.cost[1]:.5f} "
        f"({r.cost[0]:.5f}-{r.cost[2]:.5f})"
    )


def _inside(value: float, span: tuple[float, float, float]) -> bool:
    return span[0] <= value <= span[2]


def summary(rows: list[Quoted]) -> dict:
    calibrated = [r for r in rows if r.calibrated_on >= MIN_JOBS]

    def share(rs, pick) -> float | None:
        return round(sum(pick(r) for r in rs) / len(rs), 3) if rs else None

    def error(rs, span) -> float | None:
        return round(statistics.median(abs(r.actual_s / span(r)[1] - 1) for r in rs), 3) if rs else None

    def width(rs, span) -> float | None:
        return round(statistics.median(span(r)[2] / span(r)[0] for r in rs), 2) if rs else None

    return {
        "jobs": len(rows),
        "calibrated_jobs": len(calibrated),
        "in_range": {
            "calibrated": share(calibrated, lambda r: _inside(r.actual_s, r.calibrated)),
            "uncalibrated": share(rows, lambda r: _inside(r.actual_s, r.uncalibrated)),
            "uncalibrated_same_jobs": share(calibrated, lambda r: _inside(r.actual_s, r.uncalibrated)),
        },
        "cost_in_range": {
            "calibrated": share(calibrated, lambda r: _inside(r.spent, r.cost)),
            "uncalibrated_same_jobs": share(calibrated, lambda r: _inside(r.spent, r.uncalibrated_cost)),
        },
        "median_error": {
            "calibrated": error(calibrated, lambda r: r.calibrated),
            "uncalibrated_same_jobs": error(calibrated, lambda r: r.uncalibrated),
        },
        "range_width": {  # the median of high / low: how much a range says
            "calibrated": width(calibrated, lambda r: r.calibrated),
            "uncalibrated_same_jobs": width(calibrated, lambda r: r.uncalibrated),
        },
        "targets": {
            "in_range>=0.8": (share(calibrated, lambda r: _inside(r.actual_s, r.calibrated)) or 0) >= 0.8
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_JOBS} jobs")
    args = parser.parse_args()
    jobs = JOBS[:QUICK_JOBS] if args.quick else JOBS
    with tempfile.TemporaryDirectory(prefix="gpuflex-quotes-") as root:
        rows = run(jobs, Path(root))
    result = summary(rows)
    RESULTS.mkdir(exist_ok=True)
    name = "quotes-quick.json" if args.quick else "quotes.json"
    (RESULTS / name).write_text(json.dumps({"summary": result, "jobs": [asdict(r) for r in rows]}, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
