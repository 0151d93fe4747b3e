"""Runtime classes (issue 33): ``sandboxes.runtime``, the class a sandbox runs in (``container``: runc + CRIU;
``gvisor``: runsc). Rows from before are ``container``.

Revision ID: 0015_runtime_class
Revises: 0014_images
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_runtime_class"
down_revision = "0014_images"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("runtime", sa.String(16), nullable=False, server_default="container"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("runtime")
