"""Heartbeats and progress as append-only rows in the ring that holds the live attempts. See
:mod:`qstore.migrations.frozen.r0012`.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0012

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0012.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0012.downgrade(revision_shape(kw)))
