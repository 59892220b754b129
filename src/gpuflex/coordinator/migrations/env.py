"""Alembic environment: runs migrations online against the URL set by ``gpuflex.coordinator.migrate``."""

from alembic import context
from sqlalchemy import create_engine

from gpuflex.coordinator.db import Base

url = context.config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
