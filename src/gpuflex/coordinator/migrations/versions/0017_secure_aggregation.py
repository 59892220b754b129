"""secure aggregation: the messages of its rounds, relayed between a federated job's tasks

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 15:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secagg_messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("sender", sa.String(length=32), nullable=False),
        sa.Column("recipient", sa.String(length=40), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["sender"], ["tasks.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "round", "attempt", "kind", "sender"),
    )
    with op.batch_alter_table("secagg_messages", schema=None) as batch_op:
        batch_op.create_index("ix_secagg_messages_round", ["job_id", "round"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("secagg_messages", schema=None) as batch_op:
        batch_op.drop_index("ix_secagg_messages_round")
    op.drop_table("secagg_messages")
