"""``terminal_jobs`` finds a job's rows by index instead of scanning every done row. See
:mod:`qstore.migrations.frozen.r0018`.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0018

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0018.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0018.downgrade(revision_shape(kw)))
