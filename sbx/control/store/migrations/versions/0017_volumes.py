"""Persistent volumes (issue 34): ``volumes`` (names per account) and ``volume_mounts`` (which sandbox mounts which
volume where). See :mod:`sbx.control.volumes.catalog`.

Revision ID: 0017_volumes
Revises: 0016_ssh_keys
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0017_volumes"
down_revision = "0016_ssh_keys"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(64), nullable=False, index=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("size_gib", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("account_id", "name", name="uq_volumes_account_name"),
    )
    op.create_table(
        "volume_mounts",
        sa.Column("sandbox_id", sa.String(24), primary_key=True),
        sa.Column("path", sa.String(1024), primary_key=True),
        sa.Column("volume_id", sa.String(24), nullable=False, index=True),
        sa.Column("read_only", sa.Boolean, nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_table("volume_mounts")
    op.drop_table("volumes")
