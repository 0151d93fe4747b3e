"""Hosted-port routes and auto-resume: a ``routes`` table and ``sandboxes.auto_resume``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "routes",
        sa.Column("sandbox_id", sa.String(16), primary_key=True),
        sa.Column("port", sa.Integer, primary_key=True),
        sa.Column("public", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("token", sa.String(80), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("auto_resume", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("auto_resume")
    op.drop_table("routes")
