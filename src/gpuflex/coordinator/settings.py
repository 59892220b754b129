"""Coordinator configuration, read once at start-up from ``GPUFLEX_*`` variables and passed down."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuflex.auth.signing import NodeKey
from gpuflex.auth.tokens import OPERATOR_PREFIX
from gpuflex.jsonlog import LogFormat


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEX_", extra="ignore")

    data_dir: Path = Field(Path.home() / ".gpuflex" / "coordinator", description="database, blobs, keys")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite under data_dir")
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_misses: int = Field(3, ge=1, description="missed heartbeats before a node is lost")
    lease_ttl_s: float = Field(15.0, gt=0, description="a lease not renewed by heartbeats expires")
    heartbeat_max_rate_per_s: float = Field(
        1000.0,
        gt=0,
        description="the fleet's heartbeats per second at most: past it the interval grows with the fleet",
    )
    liveness_cache_s: float = Field(
        1.0, ge=0, description="how long a replica reuses the heartbeat rules (governed values, fleet size)"
    )
    reaper_interval_s: float = Field(1.0, gt=0)
    usage_settle_interval_s: float = Field(
        60.0, ge=0, description="a priced deployment key's usage is paid to the owner in a batch this often"
    )
    lease_placement_interval_s: float = Field(
        1.0,
        ge=0,
        description="a lease request that finds nothing placed on its node runs a placement pass at most "
        "this often per replica (the reaper runs one every pass): a thousand agents asking at once do not "
        "each read the whole market",
    )
    lease_ends_per_pass: int = Field(
        100,
        ge=1,
        description="per reaper pass, at most this many silent nodes judged lost and as many unrenewed "
        "leases expired (the rest wait a pass): a partition that hides many nodes does not make the "
        "coordinator re-lease everything at once",
    )
    max_request_bytes: int = Field(1 << 20, gt=0)
    keep_alive_s: int = Field(
        75,
        gt=0,
        description="how long an idle client connection stays open; longer than a heartbeat interval, so an "
        "agent's next call does not race the server closing its connection (a reset, not an answer)",
    )
    max_blob_bytes: int = Field(64 << 20, gt=0)
    blob_url: str | None = Field(
        None,
        description="where blobs live: an fsspec URL such as s3://bucket/prefix (pip install 'gpuflex[s3]'), "
        "shared by replicas; default: the directory data_dir/blobs",
    )
    blob_storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description='the store\'s options as JSON, e.g. {"endpoint_url": "http://minio:9000", "key": "…", '
        '"secret": "…"} for an S3-compatible service',
    )
    blob_url_ttl_s: float = Field(
        600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="life of a presigned URL to the object store (s3:// blob_url): readers and writers move "
        "blob bytes to and from the store themselves, within this time of asking",
    )
    signature_max_skew_s: float = Field(60.0, gt=0)
    # Per coordinator process (replicas each count on their own). An agent makes about one call a second
    # and a task a few; the defaults leave room for bursts of uploads and polling many times over.
    rate_limit_per_s: float = Field(
        100.0, gt=0, description="calls per second each API token, node and task lease may sustain"
    )
    rate_limit_burst: float = Field(1000.0, ge=1, description="calls each of them may make at once")
    anonymous_rate_limit_per_s: float = Field(
        10.0, gt=0, description="sign-ups and failed authentications per second from one client address"
    )
    anonymous_rate_limit_burst: float = Field(200.0, ge=1, description="of those, at once")
    platform_fee_bps: int = Field(1000, ge=0, le=10_000, description="platform fee in basis points")
    audit_window_s: float = Field(
        600.0, ge=0, description="a job's pay is held this long after it ends, so an audit can still stop it"
    )
    # platform_fee_bps, heartbeat_interval_s, heartbeat_misses, min_stake and audit_rate are only defaults:
    # stake may vote other values into force, so read them through ``services.governance``.
    # 0: a new network (the README's, the demo's) hires unstaked community nodes; an operator who wants a
    # verdict's slash to bite sets GPUFLEX_MIN_STAKE, as the README says
    min_stake: float = Field(0.0, ge=0, description="credits a community node must stake to take work")
    audit_rate: float = Field(0.0, ge=0, le=1, description="fraction of contributions audited")
    governance_quorum: float = Field(
        0.4, gt=0, le=1, description="fraction of all stake that must vote for a proposal to count"
    )
    governance_voting_period_s: float = Field(3 * 24 * 3600.0, gt=0, description="how long votes are open")
    governance_proposal_stake: float = Field(
        10.0, ge=0, description="credits of stake a node needs to make a proposal"
    )
    core_token: str | None = Field(None, description="operator secret to register core nodes")
    operator_token: str | None = Field(
        None, description="the operator's API token (slashing); default: made once and kept in data_dir"
    )
    ledger_key: str | None = Field(
        None,
        description="hex Ed25519 private key (32 bytes) that signs the journal; replicas must share it "
        "(default: made once in data_dir)",
    )
    open_signup: bool = Field(True, description="anyone may create a consumer account")
    log_format: LogFormat = Field("text", description="text, or json: one object per line with ids")
    dashboard_secret: str | None = Field(
        None, description="signs providers' dashboard sign-ins; replicas must share it (default: data_dir)"
    )
    dashboard_link_ttl_s: float = Field(300.0, gt=0, description="life of a provider's sign-in link")
    dashboard_session_ttl_s: float = Field(12 * 3600.0, gt=0, description="life of a dashboard sign-in")
    dashboard_refresh_s: float = Field(3.0, gt=0, description="how often live pages refresh")
    secure_cookies: bool = Field(False, description="mark dashboard cookies Secure (serve over HTTPS)")

    @field_validator("ledger_key")
    @classmethod
    def _ledger_key_is_a_key(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                NodeKey.from_hex(value)
            except ValueError:
                raise ValueError("must be a raw Ed25519 private key as 64 hex digits") from None
        return value

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'gpuflex.db'}"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    def resolved_core_token(self) -> str:
        """The operator's core token: the setting, else one made once and kept in data_dir."""
        return self.core_token or self._kept_secret("core_token")

    def resolved_operator_token(self) -> str:
        """The operator's bearer token: the setting, else one made once and kept in data_dir."""
        return self.operator_token or self._kept_secret("operator_token", prefix=OPERATOR_PREFIX)

    def resolved_dashboard_secret(self) -> str:
        """The key of providers' dashboard tokens: the setting, else one made once and kept in data_dir."""
        return self.dashboard_secret or self._kept_secret("dashboard_secret")

    def resolved_ledger_key(self) -> NodeKey:
        """The key that signs the journal: the setting, else one made once and kept in data_dir (0600)."""
        if self.ledger_key:
            return NodeKey.from_hex(self.ledger_key)
        return NodeKey.load_or_create(self.data_dir / "ledger_key.pem")

    def _kept_secret(self, name: str, *, prefix: str = "") -> str:
        path = self.data_dir / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(prefix + secrets.token_urlsafe(24))
            path.chmod(0o600)
        return path.read_text().strip()
