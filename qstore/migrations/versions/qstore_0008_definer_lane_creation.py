"""Lanes are created with the schema owner's rights (``ensure_lane`` SECURITY DEFINER), so a
runtime role without CREATE on the schema can enqueue into a new lane. See
:mod:`qstore.migrations.frozen.r0008`.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0008

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0008.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0008.downgrade(revision_shape(kw)))
