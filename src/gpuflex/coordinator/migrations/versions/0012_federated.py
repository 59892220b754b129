"""federated jobs: nodes announce private datasets and the consumers they admit; a federated worker task
is tied to its owner's node and dataset

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("private_data", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("consumers", sa.JSON(), nullable=False, server_default="[]"))
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("home_node_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("owner_dataset", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("owner_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("owner_tokens")
        batch_op.drop_column("owner_dataset")
        batch_op.drop_column("home_node_id")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("consumers")
        batch_op.drop_column("private_data")
