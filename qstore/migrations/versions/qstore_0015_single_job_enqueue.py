"""A single-job enqueue with scalar arguments (``enqueue_job``). See
:mod:`qstore.migrations.frozen.r0015`.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0015

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0015.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0015.downgrade(revision_shape(kw)))
