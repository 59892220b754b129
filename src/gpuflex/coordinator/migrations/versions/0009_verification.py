"""verification: contributions carry their commitment and audit draw; verdicts (a guilty one bars its node)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 16:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("commitment", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("audit_segment", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("audit_state", sa.String(length=64), nullable=True))
    op.create_table(
        "verdicts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("guilty", sa.Boolean(), nullable=False),
        sa.Column("check", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("slashed_micro", sa.BigInteger(), nullable=False),
        sa.Column("withheld_micro", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"]),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "round", "task_id", "check"),
    )
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_verdicts_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_verdicts_node_id"), ["node_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_verdicts_node_id"))
        batch_op.drop_index(batch_op.f("ix_verdicts_job_id"))
    op.drop_table("verdicts")
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.drop_column("audit_state")
        batch_op.drop_column("audit_segment")
        batch_op.drop_column("commitment")
