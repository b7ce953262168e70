"""A done row's ``job_id`` index entry only for wide rows (narrow rows are found through
their ready row). See :mod:`qstore.migrations.frozen.r0014`.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0014

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0014.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0014.downgrade(revision_shape(kw)))
