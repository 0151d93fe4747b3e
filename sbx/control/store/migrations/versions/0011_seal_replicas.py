"""Seal replicas (issue 10, "resume on any node ... or gone"): ``seal_replicas`` names, for a stopped sandbox, the
node holding a copy of its current seal (disk and memory image, :mod:`sbx.node.migration.replicas`), with the row's
``updated_at`` it was copied at; ``node_leftovers`` lists copies of sandboxes on nodes the store no longer puts
them on (a source that did not answer when its sandbox left it), removed when that node answers again.

Revision ID: 0011_seal_replicas
Revises: 0010_node_consolidated
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_seal_replicas"
down_revision = "0010_node_consolidated"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "seal_replicas",
        sa.Column("sandbox_id", sa.String(16), primary_key=True),
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory", sa.Boolean(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=True),
        sa.Column("sealed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("made_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "node_leftovers",
        sa.Column("sandbox_id", sa.String(16), primary_key=True),
        sa.Column("node", sa.String(64), primary_key=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_leftovers")
    op.drop_table("seal_replicas")
