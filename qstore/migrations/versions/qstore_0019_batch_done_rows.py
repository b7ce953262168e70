"""Completed attempts of the completion fast path are written as batch done rows
(``done_batches``). See :mod:`qstore.migrations.frozen.r0019`.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0019

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0019.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0019.downgrade(revision_shape(kw)))
