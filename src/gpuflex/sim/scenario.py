"""Scenarios: the world a simulation runs in, read from YAML and checked strictly.

Every model forbids unknown keys, so a typo is an error naming the key (as ``protocol.spec`` does for
job specs). A scenario describes the supply (a GPU mix with benchmark scores and asking prices, the
share of core nodes, regions, per-node links, availability sessions with a daily rhythm), the demand
(job arrivals drawn from job templates, each a real ``JobSpec``), the coordinator's liveness rules
and the on-demand cloud the costs are compared with::

    name: community-mix
    nodes: 100000            # --nodes overrides
    hours: 24                # --hours overrides
    seed: 0                  # --seed overrides
    network: {heartbeat_interval_s: 2, heartbeat_misses: 3, lease_ttl_s: 15, reaper_interval_s: 1}
    regions: [{name: us, share: 0.5, utc_offset_hours: -6}, ...]
    gpus: [{name: RTX 4090, share: 0.2, vram_gb: 24, tflops: 165, price_per_hour: [0.25, 0.6]}, ...]
    links: {bandwidth_mbps: [20, 1000], latency_ms: [10, 120]}
    availability: {session_hours_median: 6, session_sigma: 1.0, offline_hours_median: 8,
                   offline_sigma: 1.0, crash_share: 0.3, diurnal_amplitude: 0.5, peak_local_hour: 21}
    core: {share: 0.05, gpu: H100 SXM, price_per_hour: 3.0}
    jobs: {arrivals_per_hour_per_1000_nodes: 2.0, templates: [{share: 1, spec: {<a job spec>}}]}
    cloud: {name: AWS p5 (H100), price_per_hour: 12.29, tflops: 989}
    aggregator_link: {model_params: [1.25e8, 7e9], workers: 64, round_minutes: 10}   # optional
    deployments: [{per_1000_nodes: 2, spec: {<a deployment spec with model.size>}}]    # optional

The shipped scenarios (``scenarios/*.yaml``) say where each number comes from, and which are
assumptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuflex.errors import SpecError
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import JobSpec, describe_validation_error

SCENARIO_DIR = Path(__file__).parent / "scenarios"

Positive = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Range(_Strict):
    """A closed interval ``[low, high]``, written as a two-item list in YAML."""

    low: float
    high: float

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, data: object) -> object:
        if isinstance(data, list | tuple) and len(data) == 2:
            return {"low": data[0], "high": data[1]}
        return data

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"needs 0 <= low <= high, got [{self.low}, {self.high}]")
        return self


class Network(_Strict):
    """The coordinator's rules (its defaults, ``coordinator/settings.py``)."""

    heartbeat_interval_s: Positive = 2.0
    heartbeat_max_rate_per_s: Positive = 1000.0  # the fleet's beats per second at most: then it beats slower
    heartbeat_misses: Annotated[int, Field(ge=1)] = 3
    lease_ttl_s: Positive = 15.0
    reaper_interval_s: Positive = 1.0


class Region(_Strict):
    name: str
    share: Share
    utc_offset_hours: Annotated[float, Field(ge=-12, le=14)] = 0.0


class Gpu(_Strict):
    """A kind of community node: its benchmark (what the agent would measure) and its asking prices."""

    name: str
    share: Share
    vram_gb: Annotated[float, Field(ge=0)]
    tflops: Positive
    price_per_hour: Range  # asking prices, drawn uniformly, rounded to the cent


class Links(_Strict):
    bandwidth_mbps: Range  # drawn log-uniformly: home links span orders of magnitude
    latency_ms: Range  # drawn uniformly


class Availability(_Strict):
    """Community nodes come and go: log-normal on and off periods, and a daily rhythm."""

    session_hours_median: Positive
    session_sigma: Annotated[float, Field(ge=0, le=4)] = 1.0
    offline_hours_median: Positive
    offline_sigma: Annotated[float, Field(ge=0, le=4)] = 1.0
    crash_share: Annotated[float, Field(ge=0, le=1)] = Field(
        0.3, description="sessions that end silently (killed, cable cut) instead of leaving cleanly"
    )
    diurnal_amplitude: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.5, description="0: nodes return at any hour; toward 1: they return mostly around the peak hour"
    )
    peak_local_hour: Annotated[float, Field(ge=0, lt=24)] = 21.0


class Core(_Strict):
    """Platform-operated nodes: always on, they host the aggregators (and workers as fallback)."""

    share: Annotated[float, Field(ge=0, le=1)]
    gpu: str  # one of the gpus' names: its benchmark and memory
    price_per_hour: Positive
    bandwidth_mbps: Positive = 10_000.0  # a datacenter link: it carries every worker's exchange
    latency_ms: Annotated[float, Field(ge=0)] = 5.0


class JobTemplate(_Strict):
    share: Share
    spec: JobSpec  # a real job spec: the market reads its requirements, the round model its training


class Jobs(_Strict):
    arrivals_per_hour_per_1000_nodes: Positive
    templates: Annotated[list[JobTemplate], Field(min_length=1)]


class Deployments(_Strict):
    """Deployments that serve through the whole run, this many per 1,000 nodes: the engine does not place
    them; the data plane counts their replicas' model downloads (``sim.dataplane``)."""

    per_1000_nodes: Positive
    spec: DeploymentSpec  # a real deployment spec; ``model.size`` weighs its model

    @model_validator(mode="after")
    def _sized(self) -> Deployments:
        if self.spec.model.size is None:
            raise ValueError("spec.model.size is needed: it weighs the model each replica downloads")
        return self


class Cloud(_Strict):
    """The on-demand cloud a job's cost is compared with: one GPU at its list price."""

    name: str
    price_per_hour: Positive
    tflops: Positive


class AggregatorLink(_Strict):
    """The report's aggregator-bandwidth table: models of these sizes, this many workers per
    aggregator, rounds this long (``sim.bandwidth``)."""

    model_params: Annotated[list[Positive], Field(min_length=1)] = [1.25e8, 1.3e9, 7e9, 7e10]
    workers: Annotated[int, Field(ge=1)] = 64
    round_minutes: Positive = 10.0


class Scenario(_Strict):
    name: str
    description: str = ""
    nodes: Annotated[int, Field(ge=1, le=10_000_000)] = 10_000
    hours: Annotated[float, Field(gt=0, le=24 * 365)] = 24.0
    seed: Annotated[int, Field(ge=0)] = 0
    network: Network = Field(default_factory=Network)
    regions: Annotated[list[Region], Field(min_length=1)]
    gpus: Annotated[list[Gpu], Field(min_length=1)]
    links: Links
    availability: Availability
    core: Core
    jobs: Jobs
    cloud: Cloud
    aggregator_link: AggregatorLink = Field(default_factory=AggregatorLink)
    deployments: list[Deployments] = Field(default_factory=list)
    sample_every_s: Positive = Field(600.0, description="how often the report samples the network")

    @model_validator(mode="after")
    def _core_gpu_known(self) -> Scenario:
        names = [g.name for g in self.gpus]
        if self.core.gpu not in names:
            raise ValueError(f"core.gpu {self.core.gpu!r} is not one of the gpus: {names}")
        return self

    def gpu(self, name: str) -> Gpu:
        return next(g for g in self.gpus if g.name == name)


def parse_scenario(data: object, *, where: str = "scenario") -> Scenario:
    """Validate parsed YAML as a Scenario; SpecError naming every bad or unknown key."""
    if not isinstance(data, dict):
        raise SpecError(f"{where} must be a mapping of keys (name, gpus, jobs, ...)")
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid {where}: {describe_validation_error(err, Scenario)}") from None


def load_scenario(path: str | Path) -> Scenario:
    """A scenario file, or a shipped scenario by name (``community-mix``)."""
    path = Path(path)
    if not path.exists() and (SCENARIO_DIR / f"{path}.yaml").exists():
        path = SCENARIO_DIR / f"{path}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SpecError(f"cannot read scenario {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"scenario {path} is not valid YAML: {err}") from None
    return parse_scenario(data, where=f"scenario {path.name}")


def shipped() -> list[str]:
    """The names of the scenarios that ship with GPUFlex."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))
