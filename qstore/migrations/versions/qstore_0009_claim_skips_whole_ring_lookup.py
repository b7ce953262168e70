"""A claim that reached the end of a lane's chain skips the lookup through every queue-ring
child when the lane's enqueue sequence has not reached the next position. See
:mod:`qstore.migrations.frozen.r0009`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0009

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0009.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0009.downgrade(revision_shape(kw)))
