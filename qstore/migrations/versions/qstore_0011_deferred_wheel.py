"""The deferred wheel: waiting jobs are appended to time buckets and resolved by appended
marks, and a slot is reclaimed by ``TRUNCATE``; ``deferred_jobs`` stays as the overflow
beyond the wheel's span. See :mod:`qstore.migrations.frozen.r0011`.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0011

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0011.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0011.downgrade(revision_shape(kw)))
