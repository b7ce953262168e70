"""Upkeep without dead tuples; claims that never raise because upkeep holds a lock.

Ring cursors live in sequences (``<ring>_ring_generation``) behind ``<ring>_ring_state``
views, the ``<ring>_ring_slots`` tables go, the trust marker moves to ``counter_state`` and
queue-ring prunes append to ``queue_terminal_rollup_ledger``; ``claim_ready`` returns what it
claimed when a prune holds a ring child and moves its cursor hint only on the first claim of
a transaction; ``terminal_jobs`` reads a JSON ``null`` payload as absent. See
:mod:`qstore.migrations.frozen.r0006`.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0006

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0006.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0006.downgrade(revision_shape(kw)))
