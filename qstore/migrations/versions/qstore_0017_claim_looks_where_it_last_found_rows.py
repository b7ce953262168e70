"""A claim looks first in the ring slot where it last found a lane's rows (``claim_ready``). See
:mod:`qstore.migrations.frozen.r0017`.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0017

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0017.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0017.downgrade(revision_shape(kw)))
