"""Accounts, API keys, plan starts and metered usage (issue 12).

``accounts`` (id, name, plan), ``api_keys`` (sha256 of the secret, never the secret; revocable, optional expiry;
``admin`` marks the installation's key), ``starts`` (one row per create, resume or fork, for the plans' hourly
start limit), ``usage`` (per-second intervals: ``kind`` ``run`` at a size, or ``store`` of GiB; ``ended_at`` null
while open). Sandboxes and snapshots get ``account_id``; rows from before this migration belong to the
installation's first account, ``acct_default``, created here.

Revision ID: 0005_accounts
Revises: 0004_fault_fields
Create Date: 2026-12-01
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision = "0005_accounts"
down_revision = "0004_fault_fields"
branch_labels = None
depends_on = None


def upgrade() -> None:
    accounts = op.create_table(
        "accounts",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("plan", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(24), nullable=False, index=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "starts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.String(24), nullable=False, index=True),
        sa.Column("sandbox_id", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, index=True),
    )
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.String(24), nullable=False, index=True),
        sa.Column("sandbox_id", sa.String(16), nullable=True, index=True),
        sa.Column("snapshot", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("size", sa.String(32), nullable=True),
        sa.Column("gib", sa.Float, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True, index=True),
    )
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("account_id", sa.String(24), nullable=False, server_default="acct_default"))
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("account_id", sa.String(24), nullable=False, server_default="acct_default"))
    op.create_index("ix_sandboxes_account_id", "sandboxes", ["account_id"])
    op.bulk_insert(accounts, [{"id": "acct_default", "name": "default", "plan": "unlimited",
                               "created_at": dt.datetime.now(dt.UTC)}])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_account_id", "sandboxes")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("account_id")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("account_id")
    op.drop_table("usage")
    op.drop_table("starts")
    op.drop_table("api_keys")
    op.drop_table("accounts")
