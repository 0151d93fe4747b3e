"""Several nodes (issue 10): the node registry ``nodes`` and ``sandboxes.node``.

``nodes`` has one row per node agent a server heartbeats: ``name`` (the node's own name), ``url`` (``local`` for the
embedded node), ``cordoned`` (no new sandboxes go there), ``last_seen`` (the last answered heartbeat, UTC) and
``info`` (the last heartbeat: capacity, load, fingerprint; :class:`sbx.node.types.NodeInfo`). ``sandboxes.node``
names the node that holds the sandbox (null for rows made before this migration: the server's only node).

Revision ID: 0007_nodes
Revises: 0006_secrets
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_nodes"
down_revision = "0006_secrets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("url", sa.String(300), nullable=False),
        sa.Column("cordoned", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=True),
        sa.Column("info", sa.JSON, nullable=True),
    )
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("node", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("node")
    op.drop_table("nodes")
