"""Drain records (issue 11): ``drains`` keeps each node's last drain (:mod:`sbx.control.cluster.drain`), written at
every step, so every server replica answers for it and a drain whose replica died is taken over.

Revision ID: 0012_drains
Revises: 0011_seal_replicas
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_drains"
down_revision = "0011_seal_replicas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "drains",
        sa.Column("node", sa.String(64), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("drains")
