"""Abuse limits shared by every server replica (issue 35): ``rate_buckets`` (one token bucket per account key) and
``auth_attempts`` (wrong keys, and keys being checked, per client address). Used on PostgreSQL only
(:mod:`sbx.control.accounts.limits`); a single SQLite server keeps them in memory and leaves these tables empty.

Revision ID: 0018_shared_limits
Revises: 0017_volumes
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0018_shared_limits"
down_revision = "0017_volumes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rate_buckets",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("at", sa.Float, nullable=False),  # epoch seconds, the database's clock
        sa.Column("granted", sa.Boolean, nullable=False),
    )
    op.create_table(
        "auth_attempts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("client", sa.String(64), nullable=False),
        sa.Column("at", sa.Float, nullable=False),  # epoch seconds, the database's clock
    )
    op.create_index("ix_auth_attempts_client_at", "auth_attempts", ["client", "at"])


def downgrade() -> None:
    op.drop_index("ix_auth_attempts_client_at", table_name="auth_attempts")
    op.drop_table("auth_attempts")
    op.drop_table("rate_buckets")
