"""Shared fixtures: database URLs (SQLite always; PostgreSQL when one answers) and process hygiene."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from gpuflex.localnet import descendants
from gpuflex.testing import scratch_postgres_database

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _postgres_admin_url() -> tuple[str | None, str]:
    """The server to make test databases on, or None with the reason it is not usable."""
    url = os.environ.get("GPUFLEX_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 2})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as err:  # any failure to connect means: skip, and say why
        return (
            None,
            f"PostgreSQL not reachable at {make_url(url).render_as_string(hide_password=True)}: "
            f"{str(err).splitlines()[0]} (set GPUFLEX_TEST_POSTGRES_URL)",
        )
    return url, ""


@pytest.fixture(scope="session")
def postgres_server() -> str:
    url, reason = _postgres_admin_url()
    if url is None:
        pytest.skip(reason)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> Iterator[str]:
    """A new, empty database on each backend the machine has."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gpuflex.db'}"
    else:
        with scratch_postgres_database(request.getfixturevalue("postgres_server")) as url:
            yield url


@pytest.fixture(scope="module")
def postgres_database(postgres_server) -> Iterator[str]:
    """A new, empty PostgreSQL database that one test module shares."""
    with scratch_postgres_database(postgres_server) as url:
        yield url


@pytest.fixture(autouse=True)
def _no_stray_processes() -> Iterator[None]:
    """Kill whatever a test left running, so one failure can't poison the next test."""
    yield
    for pid in reversed(descendants(os.getpid())):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "tests/chaos: faults injected into a real network")
    group.addoption("--soak", action="store_true", help="longer jobs and more faults per scenario")
    group.addoption(
        "--chaos-seed", type=int, default=None, help="seed of the fault schedule [default: fixed]"
    )
