"""The Alembic migrations build exactly the schema the models describe, on every backend."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from gpuflex.coordinator.db import Base
from gpuflex.coordinator.migrate import upgrade


def test_migrations_match_the_models(database_url):
    upgrade(database_url)
    upgrade(database_url)  # idempotent
    engine = create_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
