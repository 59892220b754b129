"""inference audits: a community auditor's failed finding is an accusation a core node referees

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 18:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("inference_audits", schema=None) as batch_op:
        batch_op.add_column(sa.Column("accuser_node_id", sa.String(32), nullable=True))
        batch_op.add_column(sa.Column("accusation", sa.JSON(), nullable=True))
        batch_op.create_foreign_key("fk_inference_audits_accuser", "nodes", ["accuser_node_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("inference_audits", schema=None) as batch_op:
        batch_op.drop_constraint("fk_inference_audits_accuser", type_="foreignkey")
        batch_op.drop_column("accusation")
        batch_op.drop_column("accuser_node_id")
