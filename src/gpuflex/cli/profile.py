"""Where the CLI finds its coordinator and API token: flags, then GPUFLEX_URL / GPUFLEX_TOKEN, then the
profile file that ``gpuflex account create`` writes (``~/.gpuflex/client.json``, mode 0600)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuflex.client import Client
from gpuflex.errors import Unauthorized

DEFAULT_URL = "http://127.0.0.1:8750"


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEX_", extra="ignore")

    url: str | None = None
    token: str | None = None
    profile: Path = Field(Path.home() / ".gpuflex" / "client.json")


def _saved(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def resolve_url(url: str | None) -> str:
    settings = ClientSettings()
    return url or settings.url or _saved(settings.profile).get("url") or DEFAULT_URL


def consumer_client(url: str | None, token: str | None) -> Client:
    settings = ClientSettings()
    token = token or settings.token or _saved(settings.profile).get("token")
    if not token:
        raise Unauthorized("no API token: run `gpuflex account create NAME` or set GPUFLEX_TOKEN")
    return Client(resolve_url(url), token)


def public_client(url: str | None, token: str | None) -> Client:
    """A client for the network's public record (offers, the journal, verdicts, governance): it needs no
    token. One given (``--token``, ``GPUFLEX_TOKEN``) is sent, so the calls count as that account's; the
    saved one is not, as the URL may name another coordinator than the one it is for."""
    return Client(resolve_url(url), token or ClientSettings().token)


def save_profile(url: str, token: str) -> Path:
    path = ClientSettings().profile
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
    return path
