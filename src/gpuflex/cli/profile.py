"""Where the CLI finds its coordinator and API token.

Each of the URL and the token comes from its flag (``--url``, ``--token``), else ``GPUFLEX_URL`` /
``GPUFLEX_TOKEN``, else the chosen profile of the profile file, ``~/.gpuflex/client.json`` (mode 0600):

    {"default": "alice", "profiles": {"alice": {"url": "http://…", "token": "gfx_…"}, "bob": {…}}}

``gpuflex account create NAME`` saves profile NAME (the first one saved becomes the default) and never
replaces a profile, or a file it cannot read, without ``--force``: a token is shown once, so a lost one
is a lost account. The chosen profile is the one the global ``gpuflex --profile NAME`` or
``GPUFLEX_PROFILE`` names, else the default. The file of older versions, one ``{"url", "token"}``,
reads as a profile named ``default``.

A coordinator that serves HTTPS with a certificate of a private CA is trusted through that CA's PEM file:
the global ``gpuflex --ca FILE``, else ``GPUFLEX_CA``, else the chosen profile's ``ca`` (saved by
``account create`` when one was given); with none, the system's CAs.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuflex.client import Client
from gpuflex.errors import BadRequest, Conflict, NotFound, Unauthorized

DEFAULT_URL = "http://127.0.0.1:8750"
LEGACY_NAME = "default"


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUFLEX_", extra="ignore")

    url: str | None = None
    token: str | None = None
    profile: str | None = None
    ca: str | None = None


class Saved(BaseModel):
    """One profile: a coordinator and the token of an account on it."""

    url: str
    token: str
    ca: str | None = None  # the PEM file of the CA that signed the coordinator's certificate


class ProfileFile(BaseModel):
    """The profile file as it is stored."""

    default: str | None = None
    profiles: dict[str, Saved] = {}


def profile_path() -> Path:
    return Path.home() / ".gpuflex" / "client.json"


def masked(token: str) -> str:
    """Enough of a token to tell it from another, never enough to use it."""
    return token[:8] + "…"


@dataclass
class Profiles:
    """The profile file, read whole and written whole (atomically, mode 0600)."""

    path: Path
    default: str | None = None
    saved: dict[str, Saved] = field(default_factory=dict)

    @classmethod
    def load(cls, *, unreadable_ok: bool = False) -> Profiles:
        """The profile file (none yet: no profiles); ``unreadable_ok``: one that cannot be read as profiles
        counts as none, to be replaced (``account create --force``)."""
        path = profile_path()
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "profiles" not in data and "token" in data:
                return cls(path, LEGACY_NAME, {LEGACY_NAME: Saved.model_validate(data)})
            read = ProfileFile.model_validate(data)
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError) as err:  # ValidationError is a ValueError
            if unreadable_ok:
                return cls(path)
            why = err.errors()[0]["msg"] if isinstance(err, ValidationError) else err
            raise BadRequest(
                f"{path} is not a profile file ({why}): fix or move it (`account create --force` replaces it)"
            ) from None
        return cls(path, read.default, read.profiles)

    def get(self, name: str) -> Saved:
        if name not in self.saved:
            there = ", ".join(sorted(self.saved)) or "none: run `gpuflex account create NAME`"
            raise NotFound(f"no profile {name!r} in {self.path}; the profiles there: {there}")
        return self.saved[name]

    def check_free(self, name: str) -> None:
        """Refuse to replace a saved profile: its token was shown once, so it would be lost for good."""
        if name in self.saved:
            raise Conflict(
                f"a profile named {name!r} is saved already in {self.path}: pass --force to replace it "
                "(its token is lost then), or --no-save to only print the new token"
            )

    def add(self, name: str, profile: Saved) -> None:
        """Save ``profile`` as ``name``; the first one saved becomes the default."""
        self.saved[name] = profile
        if self.default not in self.saved:
            self.default = name

    def use(self, name: str) -> None:
        self.get(name)
        self.default = name

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = ProfileFile(default=self.default, profiles=self.saved).model_dump_json(indent=2)
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".client-", suffix=".json")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise


# ``gpuflex --profile NAME --ca FILE``: the app's callback (``cli.main``) passes them to ``choose``.
_flag: str | None = None
_ca_flag: str | None = None


def choose(name: str | None, ca: str | None = None) -> None:
    """Use profile ``name`` (and trust the CA in ``ca``) in this run of the CLI, whatever
    ``GPUFLEX_PROFILE``, ``GPUFLEX_CA`` and the default say."""
    global _flag, _ca_flag
    _flag, _ca_flag = _given("--profile", name), _given("--ca", ca)


@dataclass(frozen=True)
class Target:
    """The coordinator and token a command uses, and the profile it read them from (if any)."""

    url: str
    token: str | None
    profile: str | None = None
    why: str = ""  # why that profile: "the default", "--profile" or "GPUFLEX_PROFILE"
    ca: str | None = None  # the CA that signed the coordinator's certificate; None: the system's

    def client(self) -> Client:
        if not self.token:
            raise Unauthorized("no API token: run `gpuflex account create NAME` or set GPUFLEX_TOKEN")
        return Client(self.url, self.token, ca=self.ca)


def _given(flag: str, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise BadRequest(f"{flag} is empty")
    return value


def resolve(url: str | None = None, token: str | None = None) -> Target:
    """Each of URL and token from its flag, else its variable, else the chosen profile."""
    settings = ClientSettings()
    url, token = _given("--url", url) or settings.url, _given("--token", token) or settings.token
    ca = _ca_flag or settings.ca
    if url and token:
        return Target(url, token, ca=ca)
    profiles = Profiles.load()
    if _flag:
        name, why = _flag, "--profile"
    elif settings.profile:
        name, why = settings.profile, "GPUFLEX_PROFILE"
    else:
        name, why = profiles.default, "the default"
    if name is None:
        return Target(url or DEFAULT_URL, token, ca=ca)
    saved = profiles.get(name)
    return Target(url or saved.url, token or saved.token, name, why, ca or saved.ca)


def resolve_url(url: str | None) -> str:
    """The coordinator's URL alone (for commands that sign as a node, or need no token)."""
    return _given("--url", url) or ClientSettings().url or resolve().url


def resolve_ca(*, saved: bool = True) -> str | None:
    """The CA to verify the coordinator with: ``--ca``, else ``GPUFLEX_CA``, else (``saved``) the chosen
    profile's."""
    given = _ca_flag or ClientSettings().ca
    return given or (resolve().ca if saved else None)


def consumer_client(url: str | None, token: str | None) -> Client:
    return resolve(url, token).client()


def public_client(url: str | None, token: str | None) -> Client:
    """A client for the network's public record (offers, the journal, verdicts, governance): it needs no
    token. One given (``--token``, ``GPUFLEX_TOKEN``) is sent, so the calls count as that account's; the
    saved one is not, as the URL may name another coordinator than the one it is for."""
    return Client(resolve_url(url), _given("--token", token) or ClientSettings().token, ca=resolve_ca())
