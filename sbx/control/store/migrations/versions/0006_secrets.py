"""Secrets for the credential proxy: ``secrets`` (encrypted values and their rules), ``secret_bindings`` (which
sandbox may use which secret) and ``secret_uses`` (the audit log). See :mod:`sbx.control.secrets.vault`.

Revision ID: 0006_secrets
Revises: 0005_accounts
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_secrets"
down_revision = "0005_accounts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(64), nullable=False, index=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("ciphertext", sa.Text, nullable=False),
        sa.Column("rules", sa.JSON, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("account_id", "name", name="uq_secrets_account_name"),
    )
    op.create_table(
        "secret_bindings",
        sa.Column("sandbox_id", sa.String(16), primary_key=True),
        sa.Column("secret_id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_secret_bindings_secret", "secret_bindings", ["secret_id"])
    op.create_table(
        "secret_uses",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("secret_id", sa.String(24), nullable=False, index=True),
        sa.Column("account_id", sa.String(64), nullable=False),
        sa.Column("sandbox_id", sa.String(16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("status", sa.Integer, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("secret_uses")
    op.drop_index("ix_secret_bindings_secret", "secret_bindings")
    op.drop_table("secret_bindings")
    op.drop_table("secrets")
