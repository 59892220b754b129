"""privacy.encrypt: nodes' signed sealing keys, a job's data key sealed to its consumer, and to each lease

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 14:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sealing_key", sa.String(64), nullable=True))
        batch_op.add_column(sa.Column("sealing_key_signature", sa.String(128), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sealed_key", sa.Text(), nullable=True))
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sealed_key", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("sealed_key")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("sealed_key")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("sealing_key_signature")
        batch_op.drop_column("sealing_key")
