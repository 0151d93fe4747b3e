"""Several nodes per server (issue 10): node agents added by an admin (``sbx node add URL --token T``).

``nodes.token`` holds the node token of an added node agent, sealed with the server's secrets key
(AES-256-GCM, :func:`sbx.control.secrets.vault.seal`, bound to ``node/<name>``); null for the node a server is given by
``SBX_NODE_URL`` (or the embedded one), whose token comes from its settings.

Revision ID: 0008_node_tokens
Revises: 0007_nodes
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_node_tokens"
down_revision = "0007_nodes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("token", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("token")
