"""A claim leaves a lane once it has taken all the lane had (``claim_ready``). See
:mod:`qstore.migrations.frozen.r0016`.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0016

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0016.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0016.downgrade(revision_shape(kw)))
