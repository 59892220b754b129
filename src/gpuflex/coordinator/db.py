"""Database models and the engine/session factory (SQLite by default, PostgreSQL in production).

Times are unix seconds (floats) so comparisons behave the same on both backends. Money is
integer micro-credits. On SQLite every transaction starts with ``BEGIN IMMEDIATE`` so two
writers queue on the busy timeout instead of failing on a read-to-write upgrade.
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    false,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "accounts"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class Node(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    hardware: Mapped[dict] = mapped_column(JSON)
    benchmark: Mapped[dict] = mapped_column(JSON)
    tflops: Mapped[float] = mapped_column(Float)
    vram_gb: Mapped[float] = mapped_column(Float)
    price_micro: Mapped[int] = mapped_column(BigInteger)
    region: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), index=True)  # online | lost | left
    registered_at: Mapped[float] = mapped_column(Float)
    last_heartbeat_at: Mapped[float] = mapped_column(Float)
    # The interval the node was last told to beat at (it grows with the fleet); None: never told one.
    heartbeat_interval_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    heartbeats: Mapped[int] = mapped_column(Integer, default=0)
    # Reputation's uptime: heartbeats are expected while a node is registered and has not left. The
    # current such period began at online_since (None after leaving); presence_s sums the earlier ones.
    online_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    presence_s: Mapped[float] = mapped_column(Float, default=0.0)
    available_until: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: open-ended
    audits_passed: Mapped[int] = mapped_column(Integer, default=0)
    audits_failed: Mapped[int] = mapped_column(Integer, default=0)
    # What the node announced of its private datasets (``PrivateDataset``s) and the accounts it admits
    private_data: Mapped[list] = mapped_column(JSON, default=list)
    consumers: Mapped[list] = mapped_column(JSON, default=list)
    # privacy.encrypt: the X25519 key jobs' data keys are sealed to, signed by the node's Ed25519 key
    sealing_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sealing_key_signature: Mapped[str | None] = mapped_column(String(128), nullable=True)


class Nonce(Base):
    __tablename__ = "nonces"
    node_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    seen_at: Mapped[float] = mapped_column(Float, index=True)


class Job(Base):
    """A consumer's work: a training job, or a deployment (its sibling: the same placement, leases,
    metering and settlement; ``spec`` is a ``JobSpec`` or a ``DeploymentSpec`` by ``kind``)."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="training", server_default="training")
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict] = mapped_column(JSON)
    dataset: Mapped[str | None] = mapped_column(String(64), nullable=True)
    recipe_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    budget_micro: Mapped[int] = mapped_column(BigInteger)
    round: Mapped[int] = mapped_column(Integer, default=-1)  # newest published round
    initial_val_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    val_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    checkpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)  # newest full state
    checkpoint_round: Mapped[int] = mapped_column(Integer, default=-1)
    # An auction job's uniform worker price, set when its auction clears (market.pricing).
    clearing_price_micro: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    paid_out_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # its held pay released
    # privacy.encrypt: the job's data key sealed to its consumer (hex); None: not encrypted
    sealed_key: Mapped[str | None] = mapped_column(Text, nullable=True)


class DeploymentKey(Base):
    """An API key scoped to one deployment (its sha256 kept, as an account token's is), and what was
    served with it, counted per request. ``account_id`` holds the key and pays its per-token prices
    (micro-credits per 1M tokens; 0 for its owner's own use) to the deployment's owner, in batches
    (``deployment_keys.settle_due``): ``settled_micro`` of what its usage costs is paid so far. A key for
    another account has no ``token_hash`` until that account claims it, so its owner never holds the
    secret another pays for. The ``account_token`` row (no hash, made with the deployment) counts what
    the owner's account token was served."""

    __tablename__ = "deployment_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    deployment_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    price_in_micro: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    price_out_micro: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    settled_micro: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    settled_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    account_token: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Task(Base):
    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    index: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), index=True)  # pending | leased | completed | ...
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    node_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)  # placed on
    placement: Mapped[str] = mapped_column(Text, default="")
    failures: Mapped[int] = mapped_column(Integer, default=0)
    # A federated job's worker runs only on its owner's node, on the dataset whose manifest hashes to
    # owner_dataset, weighted by owner_tokens; None for every other task.
    home_node_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    owner_dataset: Mapped[str | None] = mapped_column(String(64), nullable=True)
    owner_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Lease(Base):
    __tablename__ = "leases"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # active | completed | failed | ...
    granted_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    renewed_at: Mapped[float] = mapped_column(Float)  # last heartbeat that renewed it: metered up to here
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    price_micro: Mapped[int] = mapped_column(BigInteger)
    cost_micro: Mapped[int] = mapped_column(BigInteger, default=0)
    # an encrypted job's data key sealed to this lease's node by the consumer; None: not (yet)
    sealed_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    # a deployment's replica: "" until it tells, downloading | loading (``protocol.relay.ReplicaPhase``),
    # serving from its first poll of the relay (it answers requests)
    phase: Mapped[str] = mapped_column(String(16), default="", server_default="")


class Round(Base):
    __tablename__ = "rounds"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    state_hash: Mapped[str] = mapped_column(String(64))
    update: Mapped[str | None] = mapped_column(String(64), nullable=True)  # aggregated compressed update
    checkpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)  # full state, when published
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    val_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    contributions: Mapped[int] = mapped_column(Integer, default=0)
    published_at: Mapped[float] = mapped_column(Float)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)  # privacy.dp: ε spent up to here


class JobTiming(Base):
    """What a completed training job took, beside what the pricing model predicted for the nodes that
    ran it: quotes are calibrated on the newest of these (``market.calibration``)."""

    __tablename__ = "job_timings"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    finished_at: Mapped[float] = mapped_column(Float, index=True)
    wall_s: Mapped[float] = mapped_column(Float)  # submitted to finished
    rounds: Mapped[int] = mapped_column(Integer)
    steady_round_s: Mapped[float] = mapped_column(Float)
    predicted_round_s: Mapped[float] = mapped_column(Float)
    time_budgeted: Mapped[bool] = mapped_column(Boolean)


class Contribution(Base):
    __tablename__ = "contributions"
    __table_args__ = (UniqueConstraint("job_id", "round", "task_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    round: Mapped[int] = mapped_column(Integer)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"))
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id"))
    node_id: Mapped[str] = mapped_column(String(32))
    delta: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    commitment: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # protocol Commitment, as sent
    audit_segment: Mapped[int | None] = mapped_column(Integer, nullable=True)  # drawn for audit: this one
    audit_state: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the worker's answer (blob)


class Verdict(Base):
    """What verification found on one contribution; a guilty one bars its node from the job."""

    __tablename__ = "verdicts"
    __table_args__ = (UniqueConstraint("job_id", "round", "task_id", "check"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    guilty: Mapped[bool] = mapped_column(Boolean)
    check: Mapped[str] = mapped_column(String(16))  # screen | audit | no-show | peer-audit | dispute
    reason: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict] = mapped_column(JSON)
    slashed_micro: Mapped[int] = mapped_column(BigInteger, default=0)
    withheld_micro: Mapped[int] = mapped_column(BigInteger, default=0)
    at: Mapped[float] = mapped_column(Float)


class PeerAudit(Base):
    """A drawn contribution's segments handed to another worker of its job (the auditor) to re-run, and
    the trace hashes it reported; the aggregator re-runs only where they disagree with the trace."""

    __tablename__ = "peer_audits"
    __table_args__ = (Index("ix_peer_audits_auditor", "job_id", "auditor_task_id"),)  # the auditor's poll
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"), primary_key=True)  # the audited task
    auditor_task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"))
    worker: Mapped[int] = mapped_column(Integer)  # whose batches to re-run on
    segment: Mapped[int] = mapped_column(Integer)  # the first segment to re-run
    state: Mapped[str] = mapped_column(String(64))  # blob: the state to re-run from
    hashes: Mapped[list | None] = mapped_column(JSON, nullable=True)  # the auditor's report; None: not yet
    created_at: Mapped[float] = mapped_column(Float)
    reported_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class InferenceAudit(Base):
    """A served request drawn for audit: what the replica claimed (prompt, output, sampling, fingerprints),
    the node that checks it (``auditor_node_id``, claimed at ``claimed_at``) and what it found."""

    __tablename__ = "inference_audits"
    __table_args__ = (Index("ix_inference_audits_state", "state", "job_id"),)  # the auditors' claim
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)  # the deployment
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id"))  # the replica that served it
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    prompt: Mapped[list] = mapped_column(JSON)
    tokens: Mapped[list] = mapped_column(JSON)
    params: Mapped[dict] = mapped_column(
        JSON
    )  # temperature, top_p, seed (up to 2**64 - 1: JSON, not a column)
    fingerprints: Mapped[list] = mapped_column(JSON)  # base64, as sent
    state: Mapped[str] = mapped_column(String(16))  # pending | referee | passed | failed
    auditor_node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    claimed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    numbers: Mapped[dict] = mapped_column(JSON, default=dict)
    # a community auditor's failed finding, which convicts no one until a core node referees it
    accuser_node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    accusation: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # its reason and numbers
    created_at: Mapped[float] = mapped_column(Float)
    judged_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class SecAggMessage(Base):
    """A message of a secure-aggregation round (``privacy.mailbox`` says who posts and reads what); the
    share bundles in it are sealed to their holders, the reveals are read by the aggregator alone."""

    __tablename__ = "secagg_messages"
    __table_args__ = (
        UniqueConstraint("job_id", "round", "attempt", "kind", "sender"),
        Index("ix_secagg_messages_round", "job_id", "round"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    round: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8))
    sender: Mapped[str] = mapped_column(ForeignKey("tasks.id"))
    recipient: Mapped[str] = mapped_column(String(40))  # a task id, "*" or "aggregator"
    body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class JobEvent(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)


class JournalEntry(Base):
    """The ledger's append-only journal; each entry's hash covers the previous one's, and the
    coordinator's ledger key signs each hash."""

    __tablename__ = "journal"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[str] = mapped_column(String(40))
    kind: Mapped[str] = mapped_column(String(32))
    memo: Mapped[str] = mapped_column(Text)
    postings: Mapped[list] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    signature: Mapped[str] = mapped_column(String(128))  # hex Ed25519 over the hash; "" before 0004


class AccountBalance(Base):
    """Balances kept beside the journal, in the same transaction, so checks need no replay."""

    __tablename__ = "balances"
    account: Mapped[str] = mapped_column(String(80), primary_key=True)
    balance: Mapped[int] = mapped_column(BigInteger, default=0)


class Slash(Base):
    """A verdict's penalty: stake taken from a node, with the evidence that justified it."""

    __tablename__ = "slashes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), nullable=True)
    amount_micro: Mapped[int] = mapped_column(BigInteger)  # taken; at most what was staked
    withheld_micro: Mapped[int] = mapped_column(BigInteger, default=0)  # the job's held pay, refunded
    evidence: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class Proposal(Base):
    """A proposed new value of a network parameter, open for stake-weighted votes until ``closes_at``."""

    __tablename__ = "proposals"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    proposer_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    parameter: Mapped[str] = mapped_column(String(64), index=True)
    value: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    closes_at: Mapped[float] = mapped_column(Float, index=True)
    effective_at: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16), index=True)  # open | passed | rejected
    tallied_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_stake: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # at the tally, micro-credits


class Vote(Base):
    """One node's vote on one proposal, weighing the node's stake when it voted (micro-credits)."""

    __tablename__ = "votes"
    __table_args__ = (UniqueConstraint("proposal_id", "node_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    proposal_id: Mapped[str] = mapped_column(ForeignKey("proposals.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"))
    choice: Mapped[str] = mapped_column(String(8))  # yes | no | abstain
    weight: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[float] = mapped_column(Float)


Index("ix_leases_active_task", Lease.task_id, Lease.state)
# The database itself refuses a second live lease of one task, whatever a replica's code does.
Index(
    "uq_leases_one_active_per_task",
    Lease.task_id,
    unique=True,
    sqlite_where=Lease.state == "active",
    postgresql_where=Lease.state == "active",
)


def try_lock(session: Session, key: int) -> bool:
    """Take a transaction-scoped lock that coordinator replicas share; False if another holds it.

    PostgreSQL: an advisory lock. SQLite: every transaction already holds the database's write lock.
    """
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": key}))


def refresh_statistics(session: Session, table: type[Base]) -> None:
    """Have PostgreSQL's planner see ``table`` as it is now (``ANALYZE``, committed with the caller's
    transaction), not as it was before a burst of writes, which autovacuum notices a minute later at
    best. SQLite: nothing; no plan of it was measured to need this."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"ANALYZE {table.__tablename__}"))


def lock(session: Session, key: int) -> None:
    """Wait for the transaction-scoped lock ``key`` (see ``try_lock``)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


READ_ONLY = "gpuflex_read_only"  # an execution option: the transaction only reads (``context.read``)


def make_engine(url: str) -> Engine:
    """An engine whose transactions serialize properly on SQLite and pool well on PostgreSQL."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # let SQLAlchemy's BEGIN below be the only one
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            # a write takes the lock up front (no upgrade deadlock); a read takes none: WAL reads beside it
            read_only = conn.get_execution_options().get(READ_ONLY)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine
    engine = create_engine(url, pool_size=10, max_overflow=20)
    _ping_idle_connections(engine)
    return engine


IDLE_PING_S = 1.0  # a pooled connection unused for longer is pinged before it is handed out


def _ping_idle_connections(engine: Engine) -> None:
    """Ping a pooled connection before use only if it sat idle: one the server may have dropped
    meanwhile (a restart, an idle timeout) is replaced, not handed out to fail. ``pool_pre_ping`` pings
    on every checkout, a round trip per transaction: the group commit's writers take a connection per
    batch, and the pings were about a tenth of the lease writer's samples (py-spy)."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn, record) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn, record, _proxy) -> None:
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None or time.monotonic() - idle_since < IDLE_PING_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as err:  # the pool disposes of it and hands out a fresh one
            raise DisconnectionError(f"a pooled connection was dead: {err}") from err


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
