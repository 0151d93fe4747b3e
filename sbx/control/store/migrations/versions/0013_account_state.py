"""Accounts that end (issue 36): ``accounts.state`` (``active``, ``suspended``, ``deleting``, ``deleted``; every
existing account is ``active``) and ``accounts.state_changed_at`` (when it last changed; null until then). See
:mod:`sbx.control.accounts.keys` and :mod:`sbx.control.cluster.accountend`.

Revision ID: 0013_account_state
Revises: 0012_drains
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_account_state"
down_revision = "0012_drains"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.add_column(sa.Column("state", sa.String(16), nullable=False, server_default="active"))
        batch.add_column(sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_accounts_state", "accounts", ["state"])


def downgrade() -> None:
    op.drop_index("ix_accounts_state", "accounts")
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("state_changed_at")
        batch.drop_column("state")
