"""privacy.dp: the ε a DP job had spent when each of its rounds was published

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 13:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.add_column(sa.Column("epsilon", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.drop_column("epsilon")
