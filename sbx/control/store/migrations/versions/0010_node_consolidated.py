"""Consolidation (issue 11): ``nodes.consolidated_at``, when the consolidation loop emptied the node (null
otherwise, and again once the node is uncordoned). A cordoned added node with no sandbox is reported
``removable``; this column says consolidation is why it is empty.

Revision ID: 0010_node_consolidated
Revises: 0009_snapshot_labels
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_node_consolidated"
down_revision = "0009_snapshot_labels"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("consolidated_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("consolidated_at")
