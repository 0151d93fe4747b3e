"""Truthful state under faults: ``sandboxes.memory_saved``, ``stop_reason``, ``stop_error``.

``memory_saved`` says whether the last stop wrote a memory image (None before any stop); ``stop_reason`` why the
sandbox last stopped (``requested``, ``idle``, ``poweroff``, ``crashed``, ``interrupted``...); ``stop_error`` what
went wrong in that stop (a failed memory save's CRIU error, a crash's detail).

Revision ID: 0004_fault_fields
Revises: 0003_labels
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_fault_fields"
down_revision = "0003_labels"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("memory_saved", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("stop_reason", sa.String(32), nullable=True))
        batch.add_column(sa.Column("stop_error", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("stop_error")
        batch.drop_column("stop_reason")
        batch.drop_column("memory_saved")
