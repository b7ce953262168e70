"""Unique-key releases as appended rows, and heartbeats that no longer write their receipt.
See :mod:`qstore.migrations.frozen.r0013`.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0013

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0013.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0013.downgrade(revision_shape(kw)))
