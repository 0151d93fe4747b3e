"""Seals in the seal store (issue 34): ``seal_archives`` names, for a stopped sandbox, the objects of its seal (disk
delta and memory image) in the seal store (:mod:`sbx.control.cluster.archive`), with the row's ``updated_at`` it was
exported at.

Revision ID: 0019_seal_archives
Revises: 0018_shared_limits
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0019_seal_archives"
down_revision = "0018_shared_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "seal_archives",
        sa.Column("sandbox_id", sa.String(16), primary_key=True),
        sa.Column("account_id", sa.String(24), nullable=False),
        sa.Column("objects", sa.JSON(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory", sa.Boolean(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=True),
        sa.Column("sealed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("made_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_seal_archives_account_id", "seal_archives", ["account_id"])


def downgrade() -> None:
    op.drop_index("ix_seal_archives_account_id", table_name="seal_archives")
    op.drop_table("seal_archives")
