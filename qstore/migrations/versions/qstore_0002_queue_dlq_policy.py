"""Per-queue DLQ policy: ``queue_meta.dlq_enabled``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from alembic import op
from qstore.migrate import migration_config

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    op.add_column(
        "queue_meta",
        sa.Column("dlq_enabled", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        schema=cfg.schema,
    )


def downgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    op.drop_column("queue_meta", "dlq_enabled", schema=cfg.schema)
