"""Every server function and view re-created from one whole SQL text each (same behaviour,
a layout that reads top to bottom). See :mod:`qstore.migrations.frozen.r0010`.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0010

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0010.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0010.downgrade(revision_shape(kw)))
