"""The deployment spec: a model served by replicas on the network, a sibling of the job spec.

A deployment is placed, leased, metered and settled as a job is; its tasks are ``server`` replicas
with no rounds, and it ends when stopped or out of budget. Strict as ``spec`` is::

    name: tuned-chat
    model: {job: j-3f2a9c1b7d0e}      # a training job of yours (its checkpoint), or {from: ./my-model}
    replicas: 2
    resources: {min_vram_gb: null, min_tflops: 0, accelerators: [], region: null}
    max_price_per_hour: 0.50
    budget: 5.00
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from gpuflex.protocol.spec import ModelSize, TrainingSpec, UploadedModel, _Strict

MAX_REPLICAS = 64
ServeDtype = Literal["auto", "bf16", "fp16", "fp32"]


class DeployedModel(_Strict):
    """What a deployment serves: exactly one of a training job of its owner's (``job``; the coordinator
    pins the job's newest checkpoint and counts its size when the deployment is created) or a model
    directory (``from``, uploaded by the CLI as a job's ``model.from`` is)."""

    model_config = ConfigDict(
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        # ``_one_source`` in the schema: each source with the fields that come with it, and not the other's
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["job"],
                    "properties": {
                        "job": {"type": "string"},
                        "from": {"type": "null"},
                        "uploaded": {"type": "null"},
                    },
                },
                {
                    "required": ["from"],
                    "properties": {
                        "from": {"type": "string"},
                        "job": {"type": "null"},
                        "checkpoint": {"type": "null"},
                        "training": {"type": "null"},
                    },
                },
            ]
        },
    )

    job: Annotated[str, Field(min_length=1, max_length=32)] | None = Field(
        None, description="a training job's id (or a unique prefix): its newest checkpoint is served"
    )
    checkpoint: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="set by the coordinator from job: the checkpoint blob served"
    )
    training: TrainingSpec | None = Field(
        None,
        description="set by the coordinator from job: its training section, which says how the checkpoint "
        "becomes a model directory (the base model it started from, LoRA)",
    )
    from_: str | None = Field(None, alias="from", description="a save_pretrained directory (CLI side)")
    uploaded: UploadedModel | None = Field(None, description="set by the CLI from `from`")
    size: ModelSize | None = Field(
        None, description="set by the CLI from `from`, by the coordinator from job: what placement sizes by"
    )

    @model_validator(mode="after")
    def _one_source(self) -> DeployedModel:
        if (self.job is None) == (self.from_ is None):
            raise ValueError("give model.job or model.from, exactly one")
        if self.job is not None and (self.uploaded is not None or self.from_ is not None):
            raise ValueError("uploaded comes with from, not with job")
        if self.from_ is not None and (self.checkpoint is not None or self.training is not None):
            raise ValueError("checkpoint and training come with job, not with from")
        return self


class ServeResources(_Strict):
    """What a replica's node must offer. GPU memory unset: the market's estimate from the model's size,
    ``context`` and ``max_batch`` (``market/memory.py``), asked of GPU nodes only."""

    min_vram_gb: Annotated[float, Field(ge=0)] | None = None
    min_tflops: Annotated[float, Field(ge=0)] = 0
    accelerators: list[str] = Field(default_factory=list, description="any-of GPU names; empty: any, CPU too")
    region: str | None = None


class DeploymentSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    model: DeployedModel
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    resources: ServeResources = Field(default_factory=ServeResources)
    max_price_per_hour: Annotated[float, Field(gt=0, le=1000)] = 1.0
    budget: Annotated[float, Field(gt=0, le=1_000_000)] = 5.0
    pricing: Literal["fixed"] = Field("fixed", description="each replica's node is paid its own price")
    audit_rate: Annotated[float, Field(ge=0, le=1)] = Field(
        0.05,
        description="the share of served requests a core node (or a replica of another provider) re-checks "
        "by one prefill of prompt + output against the replica's fingerprints",
    )
    slash: Annotated[float, Field(ge=0, le=1_000_000)] = Field(
        1.0, description="credits taken from a node's stake for a failed inference audit"
    )
    context: Annotated[int, Field(ge=16, le=1 << 20)] = Field(
        2048, description="the longest prompt plus completion a request may have, in tokens"
    )
    max_batch: Annotated[int, Field(ge=1, le=256)] = Field(
        8, description="requests a replica decodes together (continuous batching)"
    )
    dtype: ServeDtype = Field(
        "auto",
        description="the weights' and KV cache's dtype on replicas and auditors alike: auto is the model's "
        "saved dtype when 16-bit, else bf16; fp16 needs CUDA (fp32 elsewhere)",
    )
