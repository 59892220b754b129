"""Every request and response body of the HTTP API (``/v1``).

Amounts shown to people are credits (floats, USD-pegged); the ledger's own export uses
integer micro-credits so an auditor can re-add them exactly. New fields get defaults.
"""

from __future__ import annotations

import base64
import binascii
import math
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictFloat,
    StrictInt,
    WithJsonSchema,
    model_validator,
)

from gpuflex.protocol.deployment import MAX_REPLICAS, DeployedModel, DeploymentSpec, ServeDtype
from gpuflex.protocol.numbers import INT32_MAX, INT64_MAX, count, not_a_boolean
from gpuflex.protocol.spec import DATASET_NAME, JobSpec, TrainingSpec

API_VERSION = "v1"

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lower-case hex sha256 of a blob")]
X25519Key = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="a raw X25519 public key, hex")]
Ed25519Signature = Annotated[str, Field(pattern=r"^[0-9a-f]{128}$", description="an Ed25519 signature, hex")]
SealedKey = Annotated[
    str, Field(pattern=r"^[0-9a-f]{2,1024}$", description="a job's data key sealed to one X25519 key, hex")
]
NodeKind = Literal["core", "community"]
# starting: a deployment whose replicas were leased, none of which answers yet (its model loads);
# out_of_budget: ended because its budget was spent, whatever it had done by then
JobState = Literal[
    "pending", "scheduled", "starting", "running", "completed", "failed", "cancelled", "out_of_budget"
]
TrainingRole = Literal["aggregator", "worker"]
TaskRole = Literal["aggregator", "worker", "server"]  # server: a deployment's replica
# unplaced: the job ended before the task ever held a lease (it never ran; ``placement`` says why)
TaskState = Literal["pending", "leased", "completed", "failed", "cancelled", "unplaced"]
LeaseOutcome = Literal["completed", "failed", "released"]


def _finite_or_none(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


# A reported loss; a diverged one (NaN, inf) is "unknown" rather than a value JSON cannot carry.
Loss = Annotated[float | None, BeforeValidator(_finite_or_none)]


# An amount to move: at least one micro-credit, the ledger's unit (a smaller one would round to nothing).
MIN_CREDITS, MAX_CREDITS = 0.000_001, 1_000_000
Credits = Annotated[
    float, Field(ge=MIN_CREDITS, le=MAX_CREDITS, description="credits"), BeforeValidator(not_a_boolean)
]


Count32 = count(INT32_MAX)
Count64 = count(INT64_MAX)


class Message(BaseModel):
    # Every other float must be finite: NaN and inf are refused with a 422 naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- accounts and wallet ------------------------------------------------------------------


class AccountCreate(Message):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")]


class AccountCreated(Message):
    account_id: str
    name: str
    token: str = Field(description="the API token; shown once, store it")


class AccountInfo(Message):
    """Who a token belongs to (``GET /v1/accounts/me``), with the wallet's balance."""

    account_id: str
    name: str
    balance: float


class Deposit(Message):
    amount: Credits


class Balance(Message):
    account: str
    balance: float


# -- nodes --------------------------------------------------------------------------------


class GpuInfo(Message):
    name: str
    vram_gb: float
    compute_capability: str | None = None


Kernel = Literal["nf4", "int8", "adamw8bit"]  # bitsandbytes': 4-bit and 8-bit weights, 8-bit AdamW


class HardwareProfile(Message):
    cpu_model: str
    cpu_cores: Annotated[int, Field(ge=1)]
    ram_gb: Annotated[float, Field(ge=0)]
    device: Literal["cpu", "cuda"] = "cpu"
    gpus: list[GpuInfo] = Field(default_factory=list)
    kernels: Annotated[list[Kernel], Field(max_length=8)] = Field(
        default_factory=list,
        description="bitsandbytes' kernels its device runs: what a quantized base (nf4, int8) or 8-bit "
        "optimizer states (adamw8bit) need",
    )


class BenchmarkResult(Message):
    tflops_fp32: Annotated[float, Field(ge=0)]
    tflops_bf16: Annotated[float, Field(ge=0)] | None = None
    mem_bandwidth_gbps: Annotated[float, Field(ge=0)]
    seconds: float = 0.0


class PrivateDataset(Message):
    """A private dataset as its owner's node announces it: its name and size, and the hash of its manifest
    (which the owner's worker checks its data against). Nothing else of it leaves the owner's machine."""

    name: Annotated[str, Field(pattern=DATASET_NAME)]
    tokens: Annotated[
        count(INT64_MAX, minimum=1), Field(description="its train split's tokens: its FedAvg weight")
    ]
    shards: Annotated[int, Field(ge=1, le=1_000_000)]
    manifest: Sha256


MAX_PRIVATE_DATASETS = 64
AccountName = Annotated[str, Field(min_length=1, max_length=64)]


class NodeRegister(Message):
    # ``sealing_key`` and its signature come together (``_names_unique``), in the schema too
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"properties": {"sealing_key": {"type": "null"}, "sealing_key_signature": {"type": "null"}}},
                {
                    "required": ["sealing_key", "sealing_key_signature"],
                    "properties": {
                        "sealing_key": {"type": "string"},
                        "sealing_key_signature": {"type": "string"},
                    },
                },
            ]
        }
    )

    name: Annotated[str, Field(min_length=1, max_length=64)]
    public_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="raw Ed25519 public key, hex")]
    kind: NodeKind = "community"
    core_token: str | None = Field(None, description="the operator's token; required to register as core")
    hardware: HardwareProfile
    benchmark: BenchmarkResult
    price_per_hour: Annotated[float, Field(ge=0, le=1000)]
    region: Annotated[str, Field(max_length=32)] = "local"
    available_hours: Annotated[float, Field(ge=0, le=87_600)] | None = Field(
        None, description="how many more hours the node stays on offer; None: open-ended"
    )
    private_data: Annotated[list[PrivateDataset], Field(max_length=MAX_PRIVATE_DATASETS)] = Field(
        default_factory=list, description="private datasets this node trains federated jobs on, by name"
    )
    consumers: Annotated[list[AccountName], Field(max_length=1024)] = Field(
        default_factory=list, description="the accounts whose federated jobs may use its private data"
    )
    sealing_key: X25519Key | None = Field(
        None, description="the key encrypted jobs' data keys are sealed to (privacy.encrypt)"
    )
    sealing_key_signature: Ed25519Signature | None = Field(
        None,
        description="sealing_key signed by this node's Ed25519 key (auth.signing.sealing_key_statement): "
        "consumers check it, so the coordinator cannot swap in a key of its own",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> NodeRegister:
        names = [d.name for d in self.private_data]
        if len(set(names)) != len(names):
            raise ValueError("private_data names a dataset twice")
        if (self.sealing_key is None) != (self.sealing_key_signature is None):
            raise ValueError("sealing_key and sealing_key_signature come together")
        return self


class NodeRegistered(Message):
    node_id: str
    heartbeat_interval_s: float
    lease_ttl_s: float


class LeaseHeld(Message):
    lease_id: str
    epoch: Count32


class Heartbeat(Message):
    leases: list[LeaseHeld] = Field(default_factory=list)


class HeartbeatAck(Message):
    heartbeat_interval_s: float
    revoked: list[str] = Field(default_factory=list, description="leases to stop now")
    work: bool = Field(False, description="a task is placed on this node: ask for its lease now")


class DPTask(Message):
    """A DP job's settings as its tasks need them, resolved by the coordinator (``privacy.dp.for_job``)."""

    clip: float = Field(description="each owner's pseudo-gradient's L2 bound, per round")
    noise_multiplier: float = Field(description="the aggregator's noise over the average's sensitivity")
    rounds: int = Field(description="the rounds the job runs: training.rounds, or fewer by its target ε")


class TaskConfig(Message):
    """What a task subprocess needs to run: handed to it as a file by the agent."""

    job_id: str
    task_id: str
    role: TrainingRole
    worker_index: int
    num_workers: int
    training: TrainingSpec
    dataset: Sha256 | None = None
    prepared: bool = Field(
        False, description="dataset is a prepared dataset's manifest: the task fetches the shards it needs"
    )
    recipe_code: Sha256 | None = Field(None, description="the user recipe's file, with recipe 'user'")
    federated: str | None = Field(
        None,
        description="data.federated: a worker reads this private dataset on its node, whose manifest hashes "
        "to dataset; the aggregator gets no data",
    )
    weights: dict[str, Count64] | None = Field(
        None,
        description="a federated job's aggregator: each worker task's FedAvg weight (its owner's tokens)",
    )
    adversary: str | None = Field(
        None, description="testing only: the gpuflex.train.adversaries kind this worker plays"
    )
    dp: DPTask | None = Field(None, description="privacy.dp: workers clip, the aggregator adds the noise")
    encrypted: bool = Field(
        False,
        description="privacy.encrypt: every blob of the job is sealed under its data key, which the agent "
        "hands the task once the consumer sealed it to this node",
    )
    secure_aggregation: int | None = Field(
        None,
        description="privacy.secure_aggregation: its threshold; the workers mask their updates and weights "
        "goes to every task of the job",
    )


class ServerConfig(Message):
    """What a server task (a deployment's replica) needs: the model it serves and its limits."""

    job_id: str = Field(description="the deployment's id")
    task_id: str
    role: Literal["server"] = "server"
    replica: int
    model: DeployedModel
    context: int
    max_batch: int
    dtype: ServeDtype = "auto"
    adversary: str | None = Field(
        None, description="testing only: the gpuflex.serve.cheats.SERVING kind this replica plays"
    )


AnyTaskConfig = Annotated[TaskConfig | ServerConfig, Field(discriminator="role")]


class LeaseGrant(Message):
    lease_id: str
    task_id: str
    job_id: str
    role: TaskRole
    epoch: int
    expires_at: datetime
    task_token: str = Field(description="a bearer token scoped to this lease, for the task subprocess")
    task: AnyTaskConfig


class LeaseReport(Message):
    epoch: Count32
    outcome: LeaseOutcome
    detail: Annotated[str, Field(max_length=4000)] = ""


class Offer(Message):
    node_id: str
    name: str
    kind: NodeKind
    device: str
    gpu: str | None
    vram_gb: float
    tflops: float
    price_per_hour: float
    region: str
    state: str
    reliability: float | None = Field(
        None, ge=0, le=1, description="reputation score: uptime x lease completion x audits (see market)"
    )
    hours: float | None = Field(None, ge=0, description="hours left on offer; None: open-ended")


# -- blobs ---------------------------------------------------------------------------------

MAX_BLOB_KEYS = 4096  # a prepared dataset of 4,096 shards of 16 Mi tokens is 64 Gi tokens: ask in batches


class BlobKeys(Message):
    """Blob keys: which of them does the store lack? (``POST /v1/blobs/missing``)"""

    keys: Annotated[list[Sha256], Field(max_length=MAX_BLOB_KEYS)]


class MissingBlobs(Message):
    keys: list[Sha256] = Field(description="the keys asked about that the store lacks, in the order asked")
    max_blob_bytes: int = Field(description="the largest blob the coordinator accepts: upload no larger")


class BlobUpload(Message):
    """A blob about to be uploaded: ``POST /v1/blobs/uploads`` says where to send it."""

    sha256: Sha256
    length: count(INT64_MAX) = Field(description="its size in bytes, which a direct PUT must send")


class UploadTicket(Message):
    """Where a blob's bytes go: nowhere (the store has it), the coordinator (``url`` None: ``PUT
    /v1/blobs/{digest}``), or the object store itself, by a presigned PUT carrying ``headers`` before
    ``expires_at``, then named back to the coordinator (``POST /v1/blobs/uploads/done``)."""

    present: bool = Field(description="the store holds it already: send nothing")
    url: str | None = Field(None, description="a presigned PUT URL; None: send it to the coordinator")
    headers: dict[str, str] = Field(default_factory=dict, description="headers the PUT must carry as given")
    expires_at: float | None = Field(None, description="Unix time after which the URL is refused")
    upload: str | None = Field(None, description="names the upload to POST /v1/blobs/uploads/done")


class UploadDone(Message):
    """A presigned upload sent: the coordinator has the store check it and file it under its key."""

    sha256: Sha256
    upload: Annotated[str, Field(max_length=200)]


# -- jobs -----------------------------------------------------------------------------------


class JobSubmit(Message):
    spec: JobSpec
    dataset: Sha256 | None = Field(
        None,
        description="the uploaded corpus, or with data.prepared the manifest (its shards uploaded too); "
        "None if the recipe brings its own data",
    )
    recipe_code: Sha256 | None = Field(None, description="the uploaded recipe file, with recipe 'user'")
    sealed_key: SealedKey | None = Field(
        None, description="privacy.encrypt: the job's data key sealed to the consumer's own X25519 key"
    )


class KeyRequest(Message):
    """A live lease on an encrypted job whose node has no data key yet: what the consumer's CLI needs to
    check the node's sealing key (signed by the node's Ed25519 key, whose hash is its id) and seal to it."""

    lease_id: str
    epoch: Count32
    task: str = Field(description="'worker 0', 'aggregator 0'")
    node_id: str
    node_name: str
    public_key: str = Field(description="the node's Ed25519 public key, hex")
    sealing_key: X25519Key | None = Field(None, description="None: the node registered without one")
    sealing_key_signature: Ed25519Signature | None = None


class JobKeys(Message):
    job_id: str = Field(description="the job's whole id: what each node's key is sealed for")
    sealed_key: SealedKey = Field(description="the job's data key sealed to the consumer")
    requests: list[KeyRequest]
    open: bool = Field(description="whether the job still runs: the CLI stops serving keys once it ends")


class KeyGrant(Message):
    """The job's data key sealed to the node holding ``lease_id`` at ``epoch``."""

    lease_id: str
    epoch: Count32
    sealed_key: SealedKey


class LeaseKeyAsk(Message):
    epoch: Count32


class LeaseKey(Message):
    """A node's answer for its lease on an encrypted job: its sealed data key, or why it has none yet."""

    sealed_key: SealedKey | None = None
    waiting: str = ""


class JobInfo(Message):
    id: str
    name: str
    state: JobState
    created_at: datetime
    round: int
    rounds: int
    budget: float
    spent: float
    live_workers: int
    initial_val_loss: Loss = None
    val_loss: Loss = None
    train_loss: Loss = None
    checkpoint: Sha256 | None = None
    reason: str = ""


class TaskInfo(Message):
    id: str
    role: TaskRole
    index: int
    state: TaskState
    node_id: str | None
    epoch: int
    placement: str = Field(
        "", description="why the market chose this node, or why the task waits (or, unplaced, never ran)"
    )


class RoundInfo(Message):
    round: int
    update: Sha256 | None
    checkpoint: Sha256 | None
    val_loss: Loss
    train_loss: Loss
    contributions: int
    tokens: int = 0
    published_at: datetime
    epsilon: float | None = Field(None, description="privacy.dp with delta: the ε spent up to this round")


class NodeCost(Message):
    node_id: str
    name: str
    kind: NodeKind
    seconds: float
    cost: float = Field(
        description="what the job's owner pays for this node, as settlement pays it: its metered cost, "
        "cut in proportion when the budget ran out; a job's costs add up to its `spent`"
    )
    metered: float | None = Field(
        None, description="its lease time at its price; more than `cost` only when the budget ran out"
    )


class FederatedOwner(Message):
    """A node whose private data a federated job trains on, with the worker task that runs there."""

    node_id: str
    name: str
    dataset: str
    tokens: int
    task_id: str


class DPStatus(Message):
    """A DP job's privacy ledger: its settings, resolved, and the ε its published rounds spent."""

    clip: float
    noise_multiplier: float
    delta: float | None
    target_epsilon: float | None
    epsilon: float | None = Field(description="spent so far (None without delta: not accounted)")
    rounds: int = Field(description="the rounds the job runs: all it asked for, or fewer by its target")


class JobDetail(JobInfo):
    spec: JobSpec
    tasks: list[TaskInfo]
    owners: list[FederatedOwner] = Field(default_factory=list, description="data.federated: its owners")
    privacy: DPStatus | None = Field(None, description="privacy.dp: ε spent, its target and δ")
    key_waits: list[str] | None = Field(
        None,
        description="privacy.encrypt: the leased tasks waiting for the consumer to seal them the data key "
        "('worker 0 on NAME'); None: not encrypted",
    )
    rounds_log: list[RoundInfo]
    costs: list[NodeCost]
    clearing_price: float | None = Field(
        None, description="credits per hour every worker is paid, once an auction job's auction cleared"
    )
    verdicts: list[Verdict] = Field(default_factory=list, description="what verification found, newest first")


class QuoteNode(Message):
    node_id: str
    name: str
    kind: NodeKind
    role: TaskRole
    ask: float = Field(description="the node's own price, credits per hour")
    paid: float = Field(description="what it would be paid per hour: its ask, or the clearing price")
    tflops: float
    seconds_per_step: float | None = Field(None, description="expected; None for the aggregator")


class Quote(Message):
    """What a job would cost (credits) and take (seconds) if submitted now, and on which nodes; or,
    when it cannot be placed now, why (``problems``: each node that could not take a task, and why).
    Nothing is spent."""

    pricing: Literal["fixed", "auction"]
    placeable: bool
    problems: list[str] = Field(default_factory=list)
    nodes: list[QuoteNode] = Field(default_factory=list)
    clearing_price: float | None = None
    duration_s: float | None = None
    duration_low_s: float | None = None
    duration_high_s: float | None = None
    cost: float | None = Field(None, description="expected, capped by the budget")
    cost_low: float | None = None
    cost_high: float | None = None
    budget: float
    wallet: float | None = Field(None, description="the caller's wallet: a budget above it would be refused")
    budget_lasts_s: float | None = Field(None, description="set when the budget runs out before the job ends")
    shirking_pays_rounds: int | None = Field(
        None,
        description="rounds, from the first, in which a worker that skips part of its work gains more than "
        "it risks in expectation (audit rate x (slash + its held pay) < its pay for a round); 0: deterred",
    )
    slash_to_deter: float | None = Field(
        None, description="the verification.slash that deters it from the first round; None with no audits"
    )
    assumptions: list[str] = Field(default_factory=list)
    vram_estimate_gb: float | None = Field(
        None,
        description="GPU memory a worker needs by the market's estimate (on each of its local_devices), "
        "asked of GPU nodes when resources.min_vram_gb is not set; None when the model's size is unknown",
    )
    host_estimate_gb: float | None = Field(
        None, description="host memory a worker holds besides: DiLoCo's outer state, the round's start"
    )
    too_big: str | None = Field(
        None,
        description="set when the estimate exceeds every online GPU node: by how much, and what would fit",
    )
    waiting: list[str] = Field(
        default_factory=list,
        description="placeable with resources.min_workers but not every worker now: why the others would "
        "wait (they join as nodes free up)",
    )


class JobEvent(Message):
    at: datetime
    message: str


# -- deployments (a job row of kind deployment: server replicas, no rounds) ---------------------------


class DeploymentCreate(Message):
    spec: DeploymentSpec


class DeploymentScale(Message):
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)]


class DeploymentInfo(Message):
    id: str
    name: str
    state: JobState
    created_at: datetime
    model: str = Field(description="what it serves: `job j-… (checkpoint …)`, or an uploaded directory")
    replicas: int = Field(description="replicas asked for now (`scale` changes it)")
    live_replicas: int = Field(description="replicas that answer requests: leased, their model loaded")
    budget: float
    spent: float
    reason: str = Field(
        "", description="why it ended; while open, what its leased replicas that do not answer yet are doing"
    )
    # served over the last minute, as the coordinator that answers saw it (None: nothing served)
    requests_per_s: float | None = None
    tokens_per_s: float | None = Field(None, description="output tokens per second")
    ttft_p50_ms: float | None = Field(None, description="time to first token, median")
    ttft_p99_ms: float | None = None


# the most a key may charge, in credits per million tokens (a typo's price, not a business limit)
MAX_TOKEN_PRICE = 1_000_000.0


class DeploymentKeyCreate(Message):
    holder: str | None = Field(
        None, description="the account (by name) that holds the key and pays its prices; default: the owner"
    )
    price_in: Annotated[float, Field(ge=0, le=MAX_TOKEN_PRICE)] = Field(
        0.0, description="credits per million input (prompt) tokens the holder pays the owner"
    )
    price_out: Annotated[float, Field(ge=0, le=MAX_TOKEN_PRICE)] = Field(
        0.0, description="credits per million output (completion) tokens the holder pays the owner"
    )


class KeyUsage(Message):
    """A deployment's API key (never its secret), what was served with it and what that cost its holder."""

    id: str
    created_at: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int
    holder: str = Field("", description="the account that holds the key and pays for its tokens")
    account_token: bool = Field(False, description="not a key: what the owner's account token was served")
    claimed: bool = Field(True, description="False: a key for another account that it has not claimed yet")
    price_in: float = Field(0.0, description="credits per million input tokens")
    price_out: float = Field(0.0, description="credits per million output tokens")
    accrued: float = Field(0.0, description="what all its tokens cost at its prices")
    settled: float = Field(0.0, description="of that, paid into the ledger so far (settled in batches)")


class DeploymentKeyCreated(KeyUsage):
    deployment_id: str
    key: str | None = Field(
        description="the API key; shown once, store it (OpenAI clients send it as api_key). None for a key "
        "made for another account: only that account sees its secret, when it claims it"
    )


class DeploymentDetail(DeploymentInfo):
    spec: DeploymentSpec
    tasks: list[TaskInfo]
    costs: list[NodeCost]
    keys: list[KeyUsage] = Field(default_factory=list, description="its API keys and their usage")
    audits: InferenceAuditCounts = Field(default_factory=lambda: InferenceAuditCounts())
    verdicts: list[Verdict] = Field(default_factory=list, description="guilty inference audits, newest first")


# -- the task subprocess (bearer: the lease's task token) ----------------------------------


class RoundState(Message):
    """A published round of a job: how to reach its global state.

    A replica one round behind applies ``update`` (the aggregated, compressed pseudo-gradient that
    made this round) and checks ``state_hash``; a replica further behind or joining loads the full
    state ``checkpoint`` of round ``checkpoint_round`` and applies the updates after it.
    """

    round: int
    state_hash: str | None = Field(None, description="sha256 of the global parameters after this round")
    update: Sha256 | None = Field(None, description="None for round 0")
    checkpoint: Sha256 | None = Field(None, description="newest full state at or before this round")
    checkpoint_round: int = -1
    tokens: int = Field(0, description="tokens trained on, over all rounds up to this one")
    finished: bool = False
    age_s: float = Field(
        0.0, ge=0, description="seconds since it was published: a worker joining late budgets the rest"
    )


TraceHash = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$", description="a state hash, truncated to 64 bits")]
MAX_TRACE = 64  # trace hashes in a commitment: 64 keep its JSON under 1 KB


def _trace_from_wire(value: object) -> object:
    """A trace as sent: the hashes' 8-byte values, concatenated, in base64 (a third of the hex list's
    bytes, so 64 hashes fit a 1 KB commitment). A list of hex hashes passes through (built in Python)."""
    if not isinstance(value, str):
        return value
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
    if len(raw) % 8 or len(raw) > 8 * MAX_TRACE:
        raise ValueError(f"{len(raw)} bytes: not at most {MAX_TRACE} hashes of 8 bytes")
    return [raw[i : i + 8].hex() for i in range(0, len(raw), 8)]


def _trace_to_wire(trace: list[str]) -> str:
    return base64.b64encode(b"".join(bytes.fromhex(h) for h in trace)).decode()


Trace = Annotated[
    list[TraceHash],
    Field(max_length=MAX_TRACE),
    BeforeValidator(_trace_from_wire),
    PlainSerializer(_trace_to_wire, return_type=str, when_used="json"),
    WithJsonSchema(
        {
            "type": "string",
            "contentEncoding": "base64",
            # base64 of a whole number of 8-byte hashes: 24 bytes a 32-character group, then 8 or 16 more
            "pattern": r"^([A-Za-z0-9+/]{32})*([A-Za-z0-9+/]{11}=|[A-Za-z0-9+/]{22}==)?$",
            "maxLength": 4 * math.ceil(8 * MAX_TRACE / 3),
            "description": "hashes of 8 bytes each, concatenated, in base64",
        }
    ),
]


class Commitment(Message):
    """What a worker binds itself to with a contribution, so an auditor can re-run any segment of it."""

    seed: Count64 = Field(description="the seed of the generator that drew its batches")
    start: Sha256 = Field(description="hash of the parameters the round started from")
    data: Sha256 = Field(description="hash of the sample indices it trained on, in order")
    every: Annotated[int, Field(ge=1, le=INT32_MAX)] = Field(description="inner steps between trace hashes")
    trace: Trace = Field(
        description="hashes of the training state after steps every, 2·every, …, and after the last"
    )
    device: Annotated[str, Field(max_length=64)] = Field(
        description="hardware class ('cpu', 'cuda:8.0'): equal classes must reproduce the trace bitwise"
    )
    residual: TraceHash | None = Field(
        None,
        description="hash of the error-feedback residual the delta was compressed with: binds the delta "
        "to the trace's last state (delta = compress(start - last state + residual))",
    )
    residual_out: TraceHash | None = Field(
        None,
        description="hash of the residual that compression left (what the delta leaves out): the next "
        "contribution's residual must be this one (or empty, from a fresh worker)",
    )
    chain: Annotated[int, Field(ge=0, le=INT32_MAX)] = Field(
        0,
        description="compressions its residual has been through: 0 when it is empty, else one more than "
        "its previous contribution's (a younger residual carries less mass, so a smaller delta)",
    )


class ContributionSubmit(Message):
    round: Count32
    delta: Sha256 = Field(description="blob of the compressed pseudo-gradient")
    tokens: Count64
    steps: Count32
    train_loss: Loss
    commitment: Commitment | None = None


class ContributionReceipt(Message):
    accepted: bool = Field(description="false when the round had closed: the worker should catch up")
    audit_segment: int | None = Field(
        None, description="this contribution was drawn for audit: upload the state at this segment's start"
    )


class AuditStateSubmit(Message):
    round: Count32
    segment: Count32
    state: Sha256 = Field(description="blob of the training state at the segment's start")


class Contribution(Message):
    task_id: str
    node_id: str
    delta: Sha256
    tokens: int
    steps: int
    train_loss: Loss
    commitment: Commitment | None = None
    audit_segment: int | None = Field(None, description="drawn for audit: the segment to re-execute")
    audit_state: Sha256 | None = Field(None, description="the state the worker uploaded for the audit")
    carried: TraceHash | None = Field(
        None,
        description="the residual_out its task's previous contribution committed to: its residual must "
        "be that one or empty (None: no previous contribution, so empty)",
    )
    carried_chain: int | None = Field(None, description="that previous contribution's chain")


class PeerAuditAssign(Message):
    """The aggregator hands a drawn contribution's segments to another worker of its job to re-run."""

    round: Count32
    task_id: str = Field(description="the task whose contribution is audited")
    auditor: str = Field(description="the worker task that re-runs it: a second provider")
    worker: Count32 = Field(description="whose batches the contribution trained on (its seed's worker index)")
    segment: Count32 = Field(description="the first trace segment to re-run")
    state: Sha256 = Field(
        description="blob: the training state at that segment's start and each step's learning rate, "
        "none of the states the contribution committed to after it"
    )


class PeerAudit(PeerAuditAssign):
    hashes: Trace | None = Field(
        None, description="the auditor's trace hash after each re-run segment (None: not reported yet)"
    )


class PeerAuditList(Message):
    audits: list[PeerAudit]


class PeerAuditReport(Message):
    round: Count32
    task_id: str = Field(description="the task whose contribution was re-run")
    hashes: Trace = Field(description="the trace hash after each re-run segment, in order")


SecAggKind = Literal["roster", "keys", "shares", "request", "reveal"]


class SecAggPost(Message):
    """One message of a secure-aggregation round (``train.secure``), relayed by the coordinator: the
    aggregator posts the ``roster`` and the unmask ``request``; each worker its ``keys``, its sealed
    ``shares`` (all holders' in one message) and its ``reveal`` (to the aggregator alone)."""

    round: Count32
    attempt: Annotated[int, Field(ge=0, le=1000)] = Field(
        description="the round's try: a roster without the owners whose secrets never reached everyone"
    )
    kind: SecAggKind
    to: Annotated[str, Field(min_length=1, max_length=40)] = Field(
        "*", description="'*': every task of the job; 'aggregator': the aggregator alone"
    )
    body: Annotated[str, Field(max_length=4_000_000)] = Field(description="JSON, bytes as base64")


class SecAggMessage(SecAggPost):
    sender: str = Field(description="the task that posted it (the coordinator says so, not the sender)")
    seq: int = Field(description="its place in the job's messages: read on ``after`` it")


class SecAggList(Message):
    messages: list[SecAggMessage]


VerdictCheck = Literal["screen", "audit", "no-show", "peer-audit", "dispute", "inference-audit"]
Evidence = Annotated[dict[str, str | float | int | None], Field(max_length=32)]


class VerdictSubmit(Message):
    """The aggregator's (a core node's) finding on one contribution."""

    round: Count32
    task_id: str
    guilty: bool
    check: VerdictCheck = Field(
        description="screen: the aggregator's screening; audit: re-execution; "
        "no-show: the audit state never came; peer-audit: a second provider's re-run agreed; "
        "dispute: it disagreed and the core node re-ran the first segment where they differ; "
        "inference-audit: a deployment's served request re-checked by prefill (round: the audit's number)"
    )
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    evidence: Evidence = Field(default_factory=dict)


class Verdict(VerdictSubmit):
    node_id: str
    at: float
    slashed: float = Field(0.0, description="credits taken from the node's stake")
    withheld: float = Field(0.0, description="held pay of this job sent back to the consumer")


class ContributionList(Message):
    round: int
    contributions: list[Contribution]
    live_workers: int = Field(
        description="the quorum to wait for: tasks that contributed, plus workers holding a live lease "
        "whose node was heard from lately and that still owe a contribution"
    )


class RoundPublish(Message):
    round: Count32
    state_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    update: Sha256 | None = Field(None, description="the aggregated update; required after round 0")
    checkpoint: Sha256 | None = Field(None, description="the full state; required at round 0 and the last")
    val_loss: Loss = None
    train_loss: Loss = None
    contributions: Count32 = 0
    tokens: Annotated[Count64, Field(description="tokens trained on, over all rounds up to this one")] = 0


class TaskLog(Message):
    message: Annotated[str, Field(min_length=1, max_length=2000)]


# -- inference audits (a node's signature: core nodes, or a replica of another provider) -------------------


class InferenceAudit(Message):
    """A served request drawn for audit (``DeploymentSpec.audit_rate``): what the auditor re-runs by one
    prefill of ``prompt`` + ``tokens`` on its own copy of ``model`` (``serve.verify``)."""

    id: int
    deployment_id: str
    model: DeployedModel
    dtype: ServeDtype = Field("auto", description="the deployment's: what its replicas served in")
    prompt: list[int]
    tokens: list[int]
    temperature: float
    top_p: float
    seed: int
    fingerprints: list[str] = Field(description="base64, one per 32 output tokens, as the provider sent them")


class InferenceAuditClaim(Message):
    limit: Annotated[int, Field(ge=1, le=16)] = 4


class InferenceAuditList(Message):
    audits: list[InferenceAudit]


class InferenceFinding(Message):
    """The auditor's finding on one audit (``serve.verify.Finding``); ``ok`` false convicts the provider."""

    ok: bool
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    numbers: Evidence = Field(default_factory=dict)


class InferenceAuditCounts(Message):
    """A deployment's inference audits by state; ``referee``: failed by a community auditor, waiting for a
    core node's second look before anyone is convicted."""

    pending: int = 0
    referee: int = 0
    passed: int = 0
    failed: int = 0


# -- ledger -----------------------------------------------------------------------------------


# -- a node's money, and verdicts ------------------------------------------------------------

StakeSource = Literal["deposit", "earnings"]


class StakeChange(Message):
    amount: Credits
    source: StakeSource = Field("deposit", description="stake only: pay in from outside, or from earnings")


class Withdrawal(Message):
    amount: Credits


class NodeWallet(Message):
    node_id: str
    earnings: float = Field(description="paid out and withdrawable (provider:<node>)")
    held: float = Field(description="earned, held until each job's audit window passes")
    stake: float = Field(description="bonded (stake:<node>); taken by a verdict against the node")
    slashed: float = Field(0.0, description="taken by verdicts so far")


class SlashRequest(Message):
    node_id: str
    amount: Credits
    evidence: Annotated[str, Field(min_length=1, max_length=4000)]
    job_id: str | None = Field(None, description="also withhold the node's pay held for this job")


class SlashRecord(Message):
    id: str
    node_id: str
    job_id: str | None
    amount: float = Field(description="stake taken: at most what the node had staked")
    withheld: float = Field(description="the job's held pay sent back to its owner")
    evidence: str
    at: float


class Posting(Message):
    account: str
    amount: int = Field(description="micro-credits; postings of one entry sum to zero")


class LedgerEntry(Message):
    seq: int
    at: str = Field(description="ISO-8601 UTC, exactly as hashed")
    kind: str
    memo: str
    postings: list[Posting]
    prev_hash: str
    hash: str
    signature: str = Field(
        "", description="hex Ed25519 signature by the coordinator's ledger key of the entry's hash"
    )


class LedgerExport(Message):
    entries: list[LedgerEntry]
    public_key: str = Field(
        "", description="hex Ed25519 public key that signs the entries (the coordinator's)"
    )


# -- governance (stake-weighted votes on network parameters) ---------------------------------

VoteChoice = Literal["yes", "no", "abstain"]
ProposalState = Literal["open", "passed", "rejected"]


class ProposalCreate(Message):
    """Signed by the proposing node. ``effective_at`` must fall after its voting period closes."""

    parameter: Annotated[str, Field(min_length=1, max_length=64, description="GET /v1/governance/parameters")]
    value: StrictInt | StrictFloat
    effective_at: AwareDatetime
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class VoteCast(Message):
    choice: VoteChoice


class VoteInfo(Message):
    proposal_id: str
    node_id: str
    choice: VoteChoice
    weight: float = Field(description="credits: the voter's stake when it voted")
    at: datetime


class TallyInfo(Message):
    """Stake in credits. Abstaining counts toward the quorum only; yes must beat no."""

    yes: float
    no: float
    abstain: float
    total_stake: float = Field(description="all stake: now while open, at the tally once closed")
    quorum: float = Field(description="fraction of all stake that must vote")
    quorum_met: bool
    passed: bool


class ProposalInfo(Message):
    id: str
    proposer: str = Field(description="the proposing node's id")
    parameter: str
    value: StrictInt | StrictFloat
    reason: str
    created_at: datetime
    closes_at: datetime
    effective_at: datetime
    state: ProposalState
    tallied_at: datetime | None = None


class ProposalDetail(ProposalInfo):
    tally: TallyInfo
    votes: list[VoteInfo]


class ScheduledChange(Message):
    proposal_id: str
    value: StrictInt | StrictFloat
    effective_at: datetime


class ParameterInfo(Message):
    name: str
    value: StrictInt | StrictFloat = Field(description="the value in force now")
    source: str = Field(description="'setting', or the id of the passed proposal that set it")
    unit: str
    minimum: float
    maximum: float | None
    description: str
    scheduled: list[ScheduledChange] = Field(default_factory=list, description="passed, not yet in force")


class ErrorBody(Message):
    detail: str
