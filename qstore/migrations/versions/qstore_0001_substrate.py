"""qstore substrate: the three rings, control plane, functions and views.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0001

revision = "0001"
down_revision = None
branch_labels = ("qstore",)
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0001.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0001.downgrade(revision_shape(kw)))
