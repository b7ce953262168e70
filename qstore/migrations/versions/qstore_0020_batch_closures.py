"""The completion fast path closes the attempts it completes with batch closures
(``lease_claim_closure_batches``). See :mod:`qstore.migrations.frozen.r0020`.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0020

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0020.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0020.downgrade(revision_shape(kw)))
