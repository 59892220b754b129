"""one active lease per task, enforced by the database

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 01:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_ACTIVE = sa.text("state = 'active'")


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(
            "uq_leases_one_active_per_task",
            ["task_id"],
            unique=True,
            sqlite_where=_ACTIVE,
            postgresql_where=_ACTIVE,
        )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("uq_leases_one_active_per_task")
