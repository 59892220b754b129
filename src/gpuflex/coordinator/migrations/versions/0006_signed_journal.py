"""every journal entry carries the coordinator's Ed25519 signature of its hash

Entries written before this revision get an empty signature: they are not signed, and a verifier
that checks signatures names the first of them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 07:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("journal", schema=None) as batch_op:
        batch_op.add_column(sa.Column("signature", sa.String(length=128), nullable=False, server_default=""))
    with op.batch_alter_table("journal", schema=None) as batch_op:
        batch_op.alter_column("signature", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("journal", schema=None) as batch_op:
        batch_op.drop_column("signature")
