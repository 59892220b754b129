"""The job spec: what a consumer asks for, read from YAML in the spirit of SkyPilot task files.

Every model is strict (``extra="forbid"``) so a typo is an error that names the field::

    name: stdlib-char-gpt
    resources: {workers: 3, min_workers: 3, min_vram_gb: null, min_tflops: 0, accelerators: [], region: null,
                min_core_workers: 0, core_fallback: true}
    training: {recipe: char-gpt, rounds: 8, inner_steps: 30, compression: int8, batch_size: 32, lr: 0.003,
               inner_optimizer: adamw,
               precision: fp32, micro_batch_size: null, gradient_checkpointing: false, lora: null}
    data: {source: stdlib}   # or {prepared: ./prepared}: a directory `gpuflex data prepare` wrote
                             # or {federated: notes}: private datasets their owners' nodes offer by name
    privacy: {dp: {clip: 1.0, noise_multiplier: 1.1, delta: 1.0e-5, target_epsilon: 8}}  # federated only
    privacy: {encrypt: true}   # data, recipe, model directory, every blob: encrypted on the consumer's
                               # machine, the key sealed to leased nodes
    max_price_per_hour: 0.50
    budget: 2.00
    pricing: fixed          # or auction: a sealed-bid reverse auction for the workers (market/pricing.py)
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from gpuflex.errors import SpecError
from gpuflex.protocol.numbers import NOT_A_BOOLEAN, count

Recipe = Literal["char-gpt", "hf-causal-lm", "mlp-digits", "user"]
Codec = Literal["none", "fp16", "bf16", "int8", "int4", "int2"]
PREPARED_RECIPES = ("char-gpt", "hf-causal-lm")  # the recipes that train on a prepared dataset's tokens
DATASET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a private dataset's name, as its owner offers it


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Resources(_Strict):
    workers: Annotated[int, Field(ge=1, le=256), NOT_A_BOOLEAN] = 2
    min_workers: Annotated[int, Field(ge=1, le=256), NOT_A_BOOLEAN] | None = Field(
        None,
        description="training starts only once this many workers can be placed together (with the "
        "aggregator); the rest join as nodes free up. Default: all of workers",
    )
    min_vram_gb: Annotated[float, Field(ge=0), NOT_A_BOOLEAN] | None = Field(
        None,
        description="GPU memory a worker's node needs; unset: the market's estimate from the model's size, "
        "precision and LoRA (market/memory.py), asked of GPU nodes only",
    )
    min_tflops: Annotated[float, Field(ge=0), NOT_A_BOOLEAN] = 0
    accelerators: list[str] = Field(default_factory=list, description="any-of GPU names; empty: any, CPU too")
    region: str | None = None
    min_core_workers: Annotated[int, Field(ge=0), NOT_A_BOOLEAN] = Field(
        0, description="at least this many workers run on core (trusted) nodes, e.g. as a reliable backbone"
    )
    core_fallback: bool = Field(
        True,
        description="let workers beyond min_core_workers fall back to core nodes (at the core price) "
        "when community supply is short; false: they wait for community nodes",
    )

    @field_validator("min_workers")
    @classmethod
    def _min_workers_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        workers = info.data.get("workers")  # absent when workers itself was refused
        if value is not None and workers is not None and value > workers:
            raise ValueError(f"min_workers ({value}) must be at most workers ({workers})")
        return value

    @model_validator(mode="after")
    def _core_quota_fits(self) -> Resources:
        if self.min_core_workers > self.workers:
            raise ValueError(
                f"min_core_workers ({self.min_core_workers}) must be at most workers ({self.workers})"
            )
        return self


class UploadedModel(_Strict):
    """A model directory in the blob store, as ``gpuflex submit`` uploaded it from ``model.from``: the
    manifest's hash (``storage.bundles``; an encrypted job's: its ciphertext's) and the part size its
    files were cut at."""

    manifest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    part_bytes: Annotated[int, Field(ge=1, le=1 << 40), NOT_A_BOOLEAN] = Field(
        description="bundling the directory again at this part size gives the same manifest"
    )
    plain_digest: Annotated[str | None, Field(pattern=r"^[0-9a-f]{64}$")] = Field(
        None,
        description="privacy.encrypt: the plaintext manifest's HMAC under the job's data key (``manifest`` "
        "names its ciphertext), what `job fetch --format hf` checks a base directory against",
    )


class ModelSize(_Strict):
    """A model directory's size, counted by the CLI from ``model.from``: what the market sizes the job
    by. The consumer's word: a wrong count misplaces only its own job."""

    parameters: count(10**15, 1)
    trainable: count(10**15, 1) = Field(description="parameters trained: all, or LoRA's adapters")
    layers: count(10_000, 1) = 1
    hidden: count(1_000_000, 1) = 1
    vocab: count(100_000_000, 1) | None = Field(
        None, description="the config's vocab_size: the ids a prepared dataset may hold"
    )
    embeddings: count(10**15) | None = Field(
        None,
        description="parameters in the token embeddings and the output head (each tied tensor once): what a "
        "quantized base keeps unquantized",
    )
    kv_width: count(1_000_000, 1) | None = Field(
        None, description="key/value heads × head width: a layer's KV cache per token is 2 × kv_width values"
    )
    dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="the dtype the weights are saved in (config.json's dtype)"
    )


class ModelSpec(_Strict):
    """The model's shape: char-gpt's defaults give a few hundred thousand parameters.

    ``architecture`` is read by hf-causal-lm (gpt2 | llama); mlp-digits reads n_embd as its hidden
    width and n_layer as its depth. ``from`` (hf-causal-lm only) is a ``save_pretrained`` directory on
    the consumer's machine: the model is loaded from it instead, and of this section only
    ``block_size`` (the sequence length trained on) still applies; ``size`` and ``uploaded`` are what
    the CLI counted and sent of it.
    """

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    architecture: Literal["gpt2", "llama"] = "gpt2"
    n_layer: Annotated[int, Field(ge=1, le=48), NOT_A_BOOLEAN] = 2
    n_head: Annotated[int, Field(ge=1, le=64), NOT_A_BOOLEAN] = 4
    n_embd: Annotated[int, Field(ge=8, le=4096), NOT_A_BOOLEAN] = 96
    block_size: Annotated[int, Field(ge=8, le=4096), NOT_A_BOOLEAN] = 64
    dropout: Annotated[float, Field(ge=0, lt=1), NOT_A_BOOLEAN] = 0.0
    from_: str | None = Field(
        None, alias="from", description="a save_pretrained directory (config.json, *.safetensors, tokenizer)"
    )
    size: ModelSize | None = Field(None, description="set by the CLI from `from`; not written by hand")
    uploaded: UploadedModel | None = Field(
        None, description="set by the CLI from `from`; not written by hand"
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if (self.uploaded is not None or self.size is not None) and self.from_ is None:
            raise ValueError("size and uploaded come with from: they describe that directory")
        return self


class LoraSpec(_Strict):
    """LoRA adapters (through peft) on the modules named: only they train and travel."""

    r: Annotated[int, Field(ge=1, le=1024), NOT_A_BOOLEAN] = 8
    alpha: Annotated[float, Field(gt=0, le=4096), NOT_A_BOOLEAN] = 16
    dropout: Annotated[float, Field(ge=0, lt=1), NOT_A_BOOLEAN] = Field(
        0.0, description="above 0 draws random masks, which an audit does not re-draw: keep 0 to be audited"
    )
    target_modules: Annotated[list[str], Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="module names (or their last part) that get adapters, e.g. q_proj, v_proj, c_attn",
    )


class CompressionSpec(_Strict):
    """How pseudo-gradients (and the aggregated update) are encoded on the wire.

    ``method`` is a dense codec, or ``topk``: keep the ``density`` largest entries of every chunk of
    ``block_size`` values and encode them with ``values``. Error feedback keeps what the encoding
    lost on the sender and adds it next round, decayed by ``error_decay`` (1.0: plain error feedback).
    ``compression: int8`` in YAML is short for ``compression: {method: int8}``.
    """

    method: Literal["none", "fp16", "bf16", "int8", "int4", "int2", "topk"] = "int8"
    density: Annotated[float, Field(gt=0, le=1), NOT_A_BOOLEAN] = 0.02
    values: Codec = "int2"
    block_size: Annotated[int, Field(ge=8, le=65536), NOT_A_BOOLEAN] = 256
    error_decay: Annotated[float, Field(gt=0, le=1), NOT_A_BOOLEAN] = 1.0

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: object) -> object:
        return {"method": data} if isinstance(data, str) else data

    @property
    def label(self) -> str:
        """A short name for people: ``int8``, ``topk 2% + int2``."""
        return f"topk {self.density:.0%} + {self.values}" if self.method == "topk" else self.method


class VerificationSpec(_Strict):
    """How a job's contributions are checked: screened by the aggregator, a sample of them re-executed."""

    audit_rate: Annotated[float, Field(ge=0, le=1), NOT_A_BOOLEAN] = Field(
        0.05, description="the share of contributions whose one random trace segment is re-executed"
    )
    trace_every: Annotated[int, Field(ge=1, le=100_000), NOT_A_BOOLEAN] | None = Field(
        None, description="inner steps between two trace hashes; default: inner_steps / 8, at least 1"
    )
    robust: bool = Field(True, description="screen pseudo-gradients and aggregate with clipping")
    slash: Annotated[float, Field(ge=0, le=1_000_000), NOT_A_BOOLEAN] = Field(
        1.0, description="credits taken from a node's stake for each guilty verdict"
    )
    peer_segments: Annotated[int, Field(ge=0, le=64), NOT_A_BOOLEAN] = Field(
        0,
        description="re-run by a second provider: from each drawn segment, this many segments are re-run by "
        "another worker of the job, and the core node re-runs only the first segment where the two "
        "disagree (0: the core node re-runs the drawn segment itself)",
    )


class TrainingSpec(_Strict):
    recipe: Recipe = "char-gpt"
    recipe_file: str | None = Field(None, description="with recipe 'user': the Python file to run")
    rounds: Annotated[int, Field(ge=1, le=100_000), NOT_A_BOOLEAN] = 8
    inner_steps: Annotated[int, Field(ge=1, le=100_000), NOT_A_BOOLEAN] = 30
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    batch_size: Annotated[int, Field(ge=1, le=4096), NOT_A_BOOLEAN] = 32
    inner_optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="'muon': Muon for the hidden layers' weight matrices, AdamW for embeddings, head, norms "
        "and biases, at the same lr (train/optimizers.py)",
    )
    lr: Annotated[float, Field(gt=0, le=1), NOT_A_BOOLEAN] = 3e-3
    lr_schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="the inner lr over the job: 'cosine' warms up, then decays to a tenth"
    )
    warmup: Annotated[float, Field(ge=0, lt=1), NOT_A_BOOLEAN] = Field(
        0.04, description="the share of the job spent warming up"
    )
    weight_decay: Annotated[float, Field(ge=0, le=1), NOT_A_BOOLEAN] = 0.1
    outer_lr: Annotated[float, Field(gt=0, le=10), NOT_A_BOOLEAN] = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1), NOT_A_BOOLEAN] = 0.9
    seed: Annotated[int, Field(ge=0), NOT_A_BOOLEAN] = 0
    overlap: bool = Field(False, description="start the next round before this round's exchange completes")
    round_seconds: Annotated[float, Field(gt=0, le=86_400), NOT_A_BOOLEAN] | None = Field(
        None, description="time budget of a round: a faster worker runs more steps, up to inner_steps"
    )
    local_devices: Annotated[int, Field(ge=1, le=64), NOT_A_BOOLEAN] = Field(
        1, description="devices one replica spans on its node (DDP inside the replica, or FSDP with shard)"
    )
    shard: bool = Field(
        False,
        description="with local_devices > 1: shard the model, its gradients and optimizer state over them "
        "(FSDP2) instead of a whole copy on each; for a model bigger than one device",
    )
    checkpoint_every: Annotated[int, Field(ge=1, le=100_000), NOT_A_BOOLEAN] = Field(
        1, description="publish the full state (model + outer optimizer) every this many rounds"
    )
    eval_batches: Annotated[int, Field(ge=1, le=1000), NOT_A_BOOLEAN] = 8
    round_timeout_s: Annotated[float, Field(gt=0, le=86_400), NOT_A_BOOLEAN] = 120
    model: ModelSpec = Field(default_factory=ModelSpec)
    verification: VerificationSpec = Field(default_factory=VerificationSpec)
    lora: LoraSpec | None = Field(
        None, description="hf-causal-lm: train LoRA adapters instead of every weight"
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="autocast dtype of the inner steps (weights stay fp32); fp16 scales the loss, and falls "
        "back to fp32 on a CPU, which has no fp16 autocast worth the name",
    )
    micro_batch_size: Annotated[int, Field(ge=1, le=4096), NOT_A_BOOLEAN] | None = Field(
        None, description="split each batch into micro-batches of this size (gradient accumulation)"
    )
    gradient_checkpointing: bool = Field(
        False, description="hf-causal-lm: recompute activations in the backward pass to save memory"
    )
    quantize_base: Literal["nf4", "int8"] | None = Field(
        None,
        description="with lora: load the frozen base quantized (bitsandbytes; nf4 is QLoRA's 4-bit "
        "NormalFloat), the adapters in full precision; only nodes whose device runs it are offered the job",
    )
    optimizer_states: Literal["fp32", "8bit"] = Field(
        "fp32",
        description="AdamW's moments in fp32, or blockwise 8-bit (bitsandbytes' AdamW8bit): 2 bytes a "
        "trained parameter instead of 8; only nodes that run it are offered the job",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainingSpec:
        if (self.recipe == "user") != (self.recipe_file is not None):
            raise ValueError("recipe 'user' needs recipe_file, and recipe_file needs recipe 'user'")
        if self.inner_optimizer == "muon" and self.lora is not None:
            raise ValueError(
                "inner_optimizer 'muon' trains whole weight matrices; LoRA's adapters train with 'adamw'"
            )
        if self.verification.peer_segments and (self.overlap or not self.verification.robust):
            raise ValueError(
                "verification.peer_segments needs robust verification and synchronous rounds (no overlap): "
                "peers re-run segments while they wait for the round to close"
            )
        hf_only = {
            "model.from": self.model.from_ is not None,
            "lora": self.lora is not None,
            "gradient_checkpointing": self.gradient_checkpointing,
        }
        for field, used in hf_only.items():
            if used and self.recipe != "hf-causal-lm":
                raise ValueError(f"{field} needs recipe hf-causal-lm, not {self.recipe}")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.quantize_base is not None and self.lora is None:
            raise ValueError(
                f"quantize_base {self.quantize_base} quantizes a frozen base: it needs lora (a full "
                "fine-tune trains every weight, which stays in full precision)"
            )
        if self.optimizer_states == "8bit" and self.inner_optimizer != "adamw":
            raise ValueError("optimizer_states 8bit is AdamW's (bitsandbytes' AdamW8bit), not muon's")
        if self.shard and self.local_devices < 2:
            raise ValueError(
                "shard spreads a model over a node's devices: it needs local_devices of 2 or more"
            )
        if self.shard and self.quantize_base == "int8":
            raise ValueError(
                "quantize_base int8 does not combine with shard: FSDP2 shards bitsandbytes' 4-bit weights "
                "(stored as bfloat16), not its int8 ones; quantize_base nf4 does"
            )
        if self.shard and (self.inner_optimizer, self.optimizer_states) != ("adamw", "fp32"):
            raise ValueError(
                "shard trains with AdamW in fp32 states: Muon's bf16 orthogonalisation of a sharded matrix "
                "strays from the unsharded one beyond an audit's tolerance, and bitsandbytes' 8-bit AdamW "
                "does not step a DTensor shard"
            )
        if self.model.from_ is not None and self.local_devices > 1 and not self.shard:
            raise ValueError("model.from combines with local_devices > 1 only sharded (shard: true)")
        if self.local_devices > 1 and self.round_seconds is not None:
            raise ValueError(
                "round_seconds does not combine with local_devices > 1 yet (ranks step in lockstep)"
            )
        return self


class DataSpec(_Strict):
    """What the job trains on: text the CLI builds into one corpus blob (``source``), a dataset that
    ``gpuflex data prepare`` tokenized and sharded (``prepared``), or the private datasets of that name
    that owners' nodes offer (``federated``: each owner's worker trains on its own, which never leaves its
    node). At most one of the three; none given means ``source: stdlib``."""

    source: str | None = Field(
        None,
        description="'stdlib' (the Python standard library's source), a directory of text files, or 'none' "
        "(the recipe brings its own data); the default unless prepared is given",
    )
    prepared: str | None = Field(
        None,
        description="a directory `gpuflex data prepare` wrote (manifest.json and its shards): each worker "
        "fetches only its own shards and the validation split",
    )
    federated: Annotated[str, Field(pattern=DATASET_NAME)] | None = Field(
        None,
        description="the name owners offer a private dataset by (`gpuflex provider start --private-data "
        "NAME=DIR`): one worker runs on each online owner that admits this account, on its own data",
    )
    max_bytes: Annotated[int, Field(ge=10_000, le=256 * 1024 * 1024), NOT_A_BOOLEAN] = 2_000_000
    extensions: list[str] = Field(default_factory=lambda: [".py"])

    @model_validator(mode="before")
    @classmethod
    def _one_source(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        given = [k for k in ("source", "prepared", "federated") if data.get(k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give one of data.source, data.prepared and data.federated, not {' and '.join(given)}"
            )
        if not given:
            return {**data, "source": "stdlib"}
        return data


class DPSpec(_Strict):
    """Client-level differential privacy in the DP-FedAvg manner (``privacy.dp``, federated jobs only):
    each owner's pseudo-gradient clipped to L2 norm ``clip``, Gaussian noise on the average.

    ``{clip, noise_multiplier}`` (add ``delta`` to have ε accounted and shown, and ``target_epsilon`` to
    stop the job before a round would pass it: rounds capped), or ``{clip, target_epsilon, delta}``: the
    smallest noise multiplier that keeps all of ``training.rounds`` within the target (the coordinator
    computes it at submit). The ranges here are checked with the spec; the accountant's checks (a target
    one round already exceeds, one that needs more noise than ``privacy.dp.MAX_NOISE_MULTIPLIER``) at
    submit, before the budget moves."""

    clip: Annotated[float, Field(gt=0, le=1e6), NOT_A_BOOLEAN] = Field(
        description="the L2 norm each owner's pseudo-gradient is clipped to, per round"
    )
    noise_multiplier: Annotated[float, Field(gt=0, le=100), NOT_A_BOOLEAN] | None = Field(
        None, description="the noise's standard deviation over the sensitivity; unset: from target_epsilon"
    )
    target_epsilon: Annotated[float, Field(gt=0, le=100), NOT_A_BOOLEAN] | None = Field(
        None, description="the ε the job may spend at most (needs delta)"
    )
    delta: Annotated[float, Field(gt=0, lt=1), NOT_A_BOOLEAN] | None = Field(
        None, description="the δ of (ε, δ)-DP; keep it well under 1 / the owners' records"
    )

    @model_validator(mode="after")
    def _complete(self) -> DPSpec:
        if self.target_epsilon is not None and self.delta is None:
            raise ValueError("target_epsilon needs delta: ε is accounted for a δ")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("give noise_multiplier, or target_epsilon and delta")
        return self


class PrivacySpec(_Strict):
    dp: DPSpec | None = None
    encrypt: bool = Field(
        False,
        description="the dataset, the recipe file, the model directory (model.from) and every blob of the "
        "job (updates, checkpoints) encrypted "
        "(AES-GCM, a per-job data key made on the consumer's machine); the key sealed only to nodes "
        "holding a live lease on the job, by the consumer's CLI (`submit --watch`, `job keys`)",
    )
    key_wait_s: Annotated[float, Field(ge=60, le=7 * 86400), NOT_A_BOOLEAN] = Field(
        900,
        description="with encrypt: the longest a leased task waits, paid, for its data key; past it the job "
        "stops (the consumer's CLI was not serving keys) and the unspent budget comes back",
    )
    secure_aggregation: bool = Field(
        False,
        description="owners mask their updates (Bonawitz et al.): the aggregator learns only their sum "
        "(federated jobs of at least 3 owners)",
    )
    secagg_threshold: Annotated[int, Field(ge=2, le=1000), NOT_A_BOOLEAN] | None = Field(
        None,
        description="the fewest owners whose masked updates a round needs (a majority of the owners or "
        "more; default: the smallest majority, owners // 2 + 1)",
    )


class JobSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    resources: Resources = Field(default_factory=Resources)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    max_price_per_hour: Annotated[float, Field(gt=0, le=1000), NOT_A_BOOLEAN] = 1.0
    budget: Annotated[float, Field(gt=0, le=1_000_000), NOT_A_BOOLEAN] = 5.0
    pricing: Literal["fixed", "auction"] = Field(
        "fixed",
        description="fixed: each node is paid its own price; auction: the workers' k lowest asks win and "
        "each is paid the (k+1)-th lowest ask (or max_price_per_hour)",
    )
    privacy: PrivacySpec = Field(default_factory=PrivacySpec)

    @model_validator(mode="before")
    @classmethod
    def _federated_defaults(cls, data: object) -> object:
        """A federated job's contributions cannot be re-executed (only their owner holds the data): its
        verification defaults to off, and ``_consistent`` refuses it asked for. Its workers are its owners
        (the coordinator sets ``resources.workers``), so ``min_workers`` alone is no error."""
        if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
            return data
        training, resources = data.get("training", {}), data.get("resources", {})
        if data["data"].get("federated") is None or not isinstance(training, dict):
            return data
        verification = training.get("verification", {})
        if not isinstance(verification, dict) or not isinstance(resources, dict):
            return data
        if "workers" not in resources and isinstance(resources.get("min_workers"), int):
            resources = {**resources, "workers": max(resources["min_workers"], 1)}
        off = {"robust": False, "audit_rate": 0.0, **verification}
        return {**data, "training": {**training, "verification": off}, "resources": resources}

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.pricing == "auction" and self.resources.min_core_workers:
            raise ValueError("pricing 'auction' does not combine with resources.min_core_workers > 0 yet")
        token_data = "data.prepared" if self.data.prepared is not None else None
        if self.data.federated is not None:
            token_data = "data.federated"
            v = self.training.verification
            if v.robust or v.audit_rate or v.peer_segments:
                raise ValueError(
                    "data.federated: a contribution cannot be audited or screened against data only its "
                    "owner holds; leave training.verification out (robust false, audit_rate 0)"
                )
            if self.pricing == "auction" or self.resources.min_core_workers:
                raise ValueError(
                    "data.federated places one worker on each owner: no auction, no min_core_workers"
                )
        if self.privacy.dp is not None and self.data.federated is None:
            raise ValueError(
                "privacy.dp protects owners' data in a federated job: it needs data.federated (a job on "
                "uploaded data has no owner to protect from the consumer who uploaded it)"
            )
        if self.privacy.secure_aggregation and self.data.federated is None:
            raise ValueError(
                "privacy.secure_aggregation masks owners' updates in a federated job: it needs data.federated"
            )
        if self.privacy.secure_aggregation and self.training.overlap:
            raise ValueError("privacy.secure_aggregation does not combine with training.overlap yet")
        if self.privacy.secagg_threshold is not None and not self.privacy.secure_aggregation:
            raise ValueError("privacy.secagg_threshold needs privacy.secure_aggregation: true")
        if token_data is not None:
            if self.training.recipe not in PREPARED_RECIPES:
                raise ValueError(
                    f"{token_data} trains a token model: recipe {' or '.join(PREPARED_RECIPES)}, "
                    f"not {self.training.recipe}"
                )
            if self.training.local_devices > 1:
                raise ValueError(f"{token_data} does not combine with training.local_devices > 1 yet")
        return self


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem, each naming the field by its dotted path; an unknown field of ``model`` (the
    one validated) or of a model within it comes with the closest known field, or the known ones."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = _unknown(e["loc"], model) if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def _unknown(loc: tuple[int | str, ...], model: type[BaseModel]) -> str:
    """An unknown field at ``loc`` with the closest field its model knows (``did you mean r?``), or them
    all; the models come from the fields' annotations, past lists, dicts and unions."""
    models = {model}
    for step in loc[:-1]:  # a step that names no field (a list index, a dict key) keeps the models
        fields = {key: f for m in models for key, f in _keys(m).items()}
        if step in fields:
            models = _models_in(fields[step].annotation)
    known = list(dict.fromkeys(key for m in models for key in _keys(m)))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"unknown field (did you mean {close[0]}?)"
    return f"unknown field (known: {', '.join(known)})" if known else "unknown field"


def _keys(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key a spec writes them with (the alias where there is one: ``from``)."""
    return {f.alias or name: f for name, f in model.model_fields.items()}


def _models_in(annotation: object) -> set[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {annotation}
    return {m for arg in get_args(annotation) for m in _models_in(arg)}


def parse_job_spec(data: object) -> JobSpec:
    """Validate already-parsed data as a JobSpec, raising SpecError that names each bad field."""
    if not isinstance(data, dict):
        raise SpecError("job spec must be a mapping of fields (name, resources, training, ...)")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid job spec: {describe_validation_error(err, JobSpec)}") from None


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
