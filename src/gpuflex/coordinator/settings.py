"""Coordinator configuration, read once at start-up from ``GPUFLEX_*`` variables and passed down."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    core_token: str | None = Field(None, description="operator secret to register core nodes")
    open_signup: bool = Field(True, description="anyone may create a consumer account")

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'gpuflex.db'}"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def node_lost_after_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses

    def resolved_core_token(self) -> str:
        """The operator's core token: the setting, else one made once and kept in data_dir."""
        if self.core_token:
            return self.core_token
        path = self.data_dir / "core_token"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(24))
            path.chmod(0o600)
        return path.read_text().strip()
