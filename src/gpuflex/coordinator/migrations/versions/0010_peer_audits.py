"""peer audits: a drawn contribution's segments re-run by another worker of the job, and what it reported

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "peer_audits",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("auditor_task_id", sa.String(length=32), nullable=False),
        sa.Column("worker", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=64), nullable=False),
        sa.Column("hashes", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("reported_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["auditor_task_id"], ["tasks.id"]),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"]),
        sa.PrimaryKeyConstraint("job_id", "round", "task_id"),
    )
    with op.batch_alter_table("peer_audits", schema=None) as batch_op:
        batch_op.create_index("ix_peer_audits_auditor", ["job_id", "auditor_task_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("peer_audits", schema=None) as batch_op:
        batch_op.drop_index("ix_peer_audits_auditor")
    op.drop_table("peer_audits")
