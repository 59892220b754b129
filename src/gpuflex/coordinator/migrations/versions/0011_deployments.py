"""deployments: a job row's kind, training or deployment (a deployment's spec is a DeploymentSpec), and
API keys scoped to one deployment, with the usage served under each

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=16), nullable=False, server_default="training")
        )
    op.create_table(
        "deployment_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("deployment_id", sa.String(length=32), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    with op.batch_alter_table("deployment_keys", schema=None) as batch_op:
        batch_op.create_index("ix_deployment_keys_deployment_id", ["deployment_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("deployment_keys", schema=None) as batch_op:
        batch_op.drop_index("ix_deployment_keys_deployment_id")
    op.drop_table("deployment_keys")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("kind")
