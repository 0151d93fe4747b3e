"""Snapshot names per account (issue 12): ``snapshots.label``, unique per account.

A snapshot's name was one key for the whole installation, so an account asking for a name another account held
got ``409 snapshot_exists`` and learnt that the name existed. Now the name an account gives is ``label``, unique
within ``account_id``; ``name`` stays the installation-wide key the nodes and usage records use. Existing rows
get their key as their label.

Revision ID: 0009_snapshot_labels
Revises: 0008_node_tokens
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_snapshot_labels"
down_revision = "0008_node_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("label", sa.String(64), nullable=True))
    op.execute("UPDATE snapshots SET label = name WHERE label IS NULL")
    with op.batch_alter_table("snapshots") as batch:
        batch.create_unique_constraint("uq_snapshots_account_label", ["account_id", "label"])


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_constraint("uq_snapshots_account_label", type_="unique")
        batch.drop_column("label")
