"""nodes: the heartbeat interval each node was last told, so a slow-beating node is judged by its own rule

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 09:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("heartbeat_interval_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("heartbeat_interval_s")
