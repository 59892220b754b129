"""deployment keys: a holder account and per-token prices, settled into the ledger in batches (a key for
another account has no hash until its holder claims it); the owner's account-token usage on a row of its
own per deployment (``account_token``)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 15:00:00
"""

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deployment_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("account_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("price_in_micro", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("price_out_micro", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("settled_micro", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("settled_at", sa.Float(), nullable=True))
        batch_op.add_column(
            sa.Column("account_token", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.alter_column("token_hash", existing_type=sa.String(length=64), nullable=True)
    conn = op.get_bind()
    conn.execute(
        sa.text(
            "UPDATE deployment_keys SET account_id = "
            "(SELECT account_id FROM jobs WHERE jobs.id = deployment_keys.deployment_id)"
        )
    )
    deployments = conn.execute(
        sa.text("SELECT id, account_id, created_at FROM jobs WHERE kind = 'deployment'")
    ).all()
    for deployment_id, account_id, created_at in deployments:  # the owner's account-token usage row
        conn.execute(
            sa.text(
                "INSERT INTO deployment_keys (id, deployment_id, account_id, token_hash, account_token, "
                "created_at, requests, prompt_tokens, completion_tokens) "
                "VALUES (:id, :d, :a, NULL, :yes, :at, 0, 0, 0)"
            ),
            {
                "id": f"k-{secrets.token_hex(6)}",
                "d": deployment_id,
                "a": account_id,
                "yes": True,
                "at": created_at,
            },
        )
    with op.batch_alter_table("deployment_keys", schema=None) as batch_op:
        batch_op.alter_column("account_id", existing_type=sa.String(length=32), nullable=False)
        batch_op.create_foreign_key("fk_deployment_keys_account_id", "accounts", ["account_id"], ["id"])
        batch_op.create_index("ix_deployment_keys_account_id", ["account_id"], unique=False)


def downgrade() -> None:
    op.execute(
        sa.text("DELETE FROM deployment_keys WHERE token_hash IS NULL")
    )  # account-token rows, unclaimed keys
    with op.batch_alter_table("deployment_keys", schema=None) as batch_op:
        batch_op.drop_index("ix_deployment_keys_account_id")
        batch_op.drop_constraint("fk_deployment_keys_account_id", type_="foreignkey")
        batch_op.alter_column("token_hash", existing_type=sa.String(length=64), nullable=False)
        batch_op.drop_column("account_token")
        batch_op.drop_column("settled_at")
        batch_op.drop_column("settled_micro")
        batch_op.drop_column("price_out_micro")
        batch_op.drop_column("price_in_micro")
        batch_op.drop_column("account_id")
