"""A whole enqueue in one statement; eight lanes per queue by default.

Adds the server function ``enqueue_jobs`` (ids, unique keys, lane choice and reservation,
ready and scheduled rows, NOTIFY in one call) and makes ``queue_meta.enqueue_shards``
default to 8. See :mod:`qstore.migrations.frozen.r0007`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0007

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0007.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0007.downgrade(revision_shape(kw)))
