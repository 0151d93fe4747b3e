"""Initial schema: sandboxes, snapshots, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("subdomain", sa.String(80), nullable=False, unique=True),
        sa.Column("ttl", sa.Integer, nullable=False, server_default="0"),
        sa.Column("env", sa.JSON, nullable=False),
        sa.Column("no_snapshots", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("memory_restored", sa.Boolean, nullable=True),
        sa.Column("resume_reason", sa.String(32), nullable=True),
        sa.Column("has_memory", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("source_id", sa.String(16), nullable=True),
        sa.Column("from_snapshot", sa.String(64), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_sandboxes_state", "sandboxes", ["state"])
    op.create_table(
        "snapshots",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("sandbox_id", sa.String(16), nullable=False),
        sa.Column("auto", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("size_mib", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_snapshots_sandbox_id", "snapshots", ["sandbox_id"])
    op.create_table(
        "events",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("sandbox_id", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", sa.JSON, nullable=False),
    )
    op.create_index("ix_events_sandbox_id", "events", ["sandbox_id"])


def downgrade() -> None:
    op.drop_table("events")
    op.drop_table("snapshots")
    op.drop_table("sandboxes")
