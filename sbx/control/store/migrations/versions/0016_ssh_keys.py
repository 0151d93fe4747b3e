"""SSH public keys of accounts (issue 35): ``ssh_keys``, what the SSH gateway lets in. See
:mod:`sbx.control.accounts.sshkeys`.

Revision ID: 0016_ssh_keys
Revises: 0015_runtime_class
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_ssh_keys"
down_revision = "0015_runtime_class"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ssh_keys",
        sa.Column("id", sa.String(24), primary_key=True),
        sa.Column("account_id", sa.String(24), nullable=False, index=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("algorithm", sa.String(64), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False, index=True),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("account_id", "fingerprint", name="uq_ssh_keys_account_fingerprint"),
    )


def downgrade() -> None:
    op.drop_table("ssh_keys")
