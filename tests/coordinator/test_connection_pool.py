"""The PostgreSQL pool pings a connection only if it sat idle: one the server dropped meanwhile is
replaced before anyone uses it, and a busy coordinator's connections, reused at once, cost no round trip."""

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from gpuflex.coordinator import db


def _connection_pid(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT pg_backend_pid()")).scalar_one()


def _terminate(server_url: str, pid: int) -> None:
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
    admin.dispose()


@pytest.fixture
def engine(postgres_database):
    engine = db.make_engine(postgres_database)
    yield engine
    engine.dispose()


@pytest.fixture
def pings(engine, monkeypatch) -> list[int]:
    counted: list[int] = []
    ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda conn: counted.append(1) or ping(conn))
    return counted


def test_a_connection_the_server_dropped_while_idle_is_replaced_before_use(
    engine, pings, postgres_server, monkeypatch
):
    dropped = _connection_pid(engine)
    _terminate(postgres_server, dropped)
    monkeypatch.setattr(db, "IDLE_PING_S", 0.0)  # as if it had sat idle past the limit
    assert _connection_pid(engine) != dropped  # a fresh connection, and no error
    assert pings == [1]


def test_a_connection_reused_at_once_is_not_pinged_and_a_dropped_one_then_fails(
    engine, pings, postgres_server
):
    pid = _connection_pid(engine)
    assert [_connection_pid(engine) for _ in range(5)] == [pid] * 5  # the same connection, reused
    assert pings == []
    _terminate(postgres_server, pid)
    with pytest.raises(OperationalError):  # what the ping of an idle connection spares its user
        _connection_pid(engine)
