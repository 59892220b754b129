"""slashes, and when a job's held pay was released

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "slashes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.Column("withheld_micro", sa.BigInteger(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("slashes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_slashes_node_id"), ["node_id"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("paid_out_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("paid_out_at")
    with op.batch_alter_table("slashes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_slashes_node_id"))
    op.drop_table("slashes")
