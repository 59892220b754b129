"""The job spec: what a consumer asks for, read from YAML in the spirit of SkyPilot task files.

Every model is strict (``extra="forbid"``) so a typo is an error that names the field::

    name: stdlib-char-gpt
    resources: {workers: 3, min_vram_gb: 0, min_tflops: 0, accelerators: [], region: null}
    training: {recipe: char-gpt, rounds: 8, inner_steps: 30, compression: int8, batch_size: 32, lr: 0.003}
    data: {source: stdlib}
    max_price_per_hour: 0.50
    budget: 2.00
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuflex.errors import SpecError

Compression = Literal["none", "fp16", "int8"]
Recipe = Literal["char-gpt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Resources(_Strict):
    workers: Annotated[int, Field(ge=1, le=256)] = 2
    min_vram_gb: Annotated[float, Field(ge=0)] = 0
    min_tflops: Annotated[float, Field(ge=0)] = 0
    accelerators: list[str] = Field(default_factory=list, description="any-of GPU names; empty: any, CPU too")
    region: str | None = None


class ModelSpec(_Strict):
    """char-gpt's shape: nanoGPT-style, a few hundred thousand parameters by default."""

    n_layer: Annotated[int, Field(ge=1, le=48)] = 2
    n_head: Annotated[int, Field(ge=1, le=64)] = 4
    n_embd: Annotated[int, Field(ge=8, le=4096)] = 96
    block_size: Annotated[int, Field(ge=8, le=4096)] = 64
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self


class TrainingSpec(_Strict):
    recipe: Recipe = "char-gpt"
    rounds: Annotated[int, Field(ge=1, le=100_000)] = 8
    inner_steps: Annotated[int, Field(ge=1, le=100_000)] = 30
    compression: Compression = "int8"
    batch_size: Annotated[int, Field(ge=1, le=4096)] = 32
    lr: Annotated[float, Field(gt=0, le=1)] = 3e-3
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.1
    outer_lr: Annotated[float, Field(gt=0, le=10)] = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    seed: Annotated[int, Field(ge=0)] = 0
    eval_batches: Annotated[int, Field(ge=1, le=1000)] = 8
    round_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 120
    model: ModelSpec = Field(default_factory=ModelSpec)


class DataSpec(_Strict):
    source: str = Field(
        "stdlib", description="'stdlib' (the Python standard library's source) or a directory"
    )
    max_bytes: Annotated[int, Field(ge=10_000, le=256 * 1024 * 1024)] = 2_000_000
    extensions: list[str] = Field(default_factory=lambda: [".py"])


class JobSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    resources: Resources = Field(default_factory=Resources)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    max_price_per_hour: Annotated[float, Field(gt=0, le=1000)] = 1.0
    budget: Annotated[float, Field(gt=0, le=1_000_000)] = 5.0


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, each naming the field by its dotted path."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_job_spec(data: object) -> JobSpec:
    """Validate already-parsed data as a JobSpec, raising SpecError that names each bad field."""
    if not isinstance(data, dict):
        raise SpecError("job spec must be a mapping of fields (name, resources, training, ...)")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid job spec: {describe_validation_error(err)}") from None


def job_spec_from_yaml(text: str) -> JobSpec:
    """Parse YAML text as a JobSpec."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"job spec is not valid YAML: {err}") from None
    return parse_job_spec(data)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a job spec from a YAML file."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise SpecError(f"cannot read job spec {path}: {err.strerror}") from None
    return job_spec_from_yaml(text)
