"""Images (issue 32): the ``images`` table (an account's base images built from a Dockerfile or imported from an
OCI/docker archive; ``shared`` ones are visible to every account) and ``sandboxes.image`` (the image a sandbox's
disk came from: its name, id and facts; null for sbx's default image). See :mod:`sbx.control.images.catalog`.

Revision ID: 0014_images
Revises: 0013_account_state
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_images"
down_revision = "0013_account_state"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "images",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("shared", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("node", sa.String(64), nullable=True),
        sa.Column("facts", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("account_id", "name", name="uq_images_account_name"),
    )
    op.create_index("ix_images_account_id", "images", ["account_id"])
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("image_id", sa.String(24), nullable=True))
        batch.add_column(sa.Column("image", sa.JSON(), nullable=True))
    op.create_index("ix_sandboxes_image_id", "sandboxes", ["image_id"])


def downgrade() -> None:
    op.drop_index("ix_sandboxes_image_id", "sandboxes")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("image")
        batch.drop_column("image_id")
    op.drop_index("ix_images_account_id", "images")
    op.drop_table("images")
