"""Coordinator configuration, read once at start-up from ``GPUFLEX_*`` variables and passed down."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuflex.jsonlog import LogFormat


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEX_", extra="ignore")

    data_dir: Path = Field(Path.home() / ".gpuflex" / "coordinator", description="database, blobs, keys")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite under data_dir")
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_misses: int = Field(3, ge=1, description="missed heartbeats before a node is lost")
    lease_ttl_s: float = Field(15.0, gt=0, description="a lease not renewed by heartbeats expires")
    reaper_interval_s: float = Field(1.0, gt=0)
    max_request_bytes: int = Field(1 << 20, gt=0)
    max_blob_bytes: int = Field(64 << 20, gt=0)
    signature_max_skew_s: float = Field(60.0, gt=0)
    platform_fee_bps: int = Field(1000, ge=0, le=10_000, description="platform fee in basis points")
    # platform_fee_bps, heartbeat_interval_s, heartbeat_misses, min_stake and audit_rate are only defaults:
    # stake may vote other values into force, so read them through ``services.governance``.
    min_stake: float = Field(0.0, ge=0, description="credits of stake a node must bond to take work")
    audit_rate: float = Field(0.0, ge=0, le=1, description="fraction of contributions audited")
    governance_quorum: float = Field(
        0.4, gt=0, le=1, description="fraction of all stake that must vote for a proposal to count"
    )
    governance_voting_period_s: float = Field(3 * 24 * 3600.0, gt=0, description="how long votes are open")
    governance_proposal_stake: float = Field(
        10.0, ge=0, description="credits of stake a node needs to make a proposal"
    )
    core_token: str | None = Field(None, description="operator secret to register core nodes")
    open_signup: bool = Field(True, description="anyone may create a consumer account")
    log_format: LogFormat = Field("text", description="text, or json: one object per line with ids")
    dashboard_secret: str | None = Field(
        None, description="signs providers' dashboard sign-ins; replicas must share it (default: data_dir)"
    )
    dashboard_link_ttl_s: float = Field(300.0, gt=0, description="life of a provider's sign-in link")
    dashboard_session_ttl_s: float = Field(12 * 3600.0, gt=0, description="life of a dashboard sign-in")
    dashboard_refresh_s: float = Field(3.0, gt=0, description="how often live pages refresh")
    secure_cookies: bool = Field(False, description="mark dashboard cookies Secure (serve over HTTPS)")

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'gpuflex.db'}"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    def resolved_core_token(self) -> str:
        """The operator's core token: the setting, else one made once and kept in data_dir."""
        return self.core_token or self._kept_secret("core_token")

    def resolved_dashboard_secret(self) -> str:
        """The key of providers' dashboard tokens: the setting, else one made once and kept in data_dir."""
        return self.dashboard_secret or self._kept_secret("dashboard_secret")

    def _kept_secret(self, name: str) -> str:
        path = self.data_dir / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(24))
            path.chmod(0o600)
        return path.read_text().strip()
