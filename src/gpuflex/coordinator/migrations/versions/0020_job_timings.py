"""job_timings: what each completed job took beside the pricing model's prediction, for calibrated quotes

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_timings",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("rounds", sa.Integer(), nullable=False),
        sa.Column("steady_round_s", sa.Float(), nullable=False),
        sa.Column("predicted_round_s", sa.Float(), nullable=False),
        sa.Column("time_budgeted", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_job_timings_finished_at", "job_timings", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_job_timings_finished_at", table_name="job_timings")
    op.drop_table("job_timings")
