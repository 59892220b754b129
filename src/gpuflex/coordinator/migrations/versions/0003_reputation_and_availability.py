"""nodes: what reputation counts (time present, audits) and how long a node stays on offer

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("online_since", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("presence_s", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("available_until", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("audits_passed", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("audits_failed", sa.Integer(), nullable=False, server_default="0"))
    # Nodes already known: present since they registered, up to their last heartbeat if they left.
    op.execute("UPDATE nodes SET online_since = registered_at WHERE state != 'left'")
    op.execute("UPDATE nodes SET presence_s = last_heartbeat_at - registered_at WHERE state = 'left'")


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        for column in ("audits_failed", "audits_passed", "available_until", "presence_s", "online_since"):
            batch_op.drop_column(column)
