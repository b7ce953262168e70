"""Claim queues on a busy lane instead of returning empty; completion takes the job kind
from the worker's claim snapshot.

* ``claim_ready`` (same signature): lanes are ordered without reading ready rows when aging
  is off; when every lane with work is locked by another claimer the call waits (bounded by
  the function's ``lock_timeout``) for the first one instead of returning nothing; claim
  ranges are probed in the slot of the row they start at; the tombstone probe is pruned to
  the claimed segment's slot.
* ``complete_receipts`` gains ``p_kinds text[]`` (the kind each worker got from its claim),
  so the fast path no longer joins the ready rows.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0003

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0003.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0003.downgrade(revision_shape(kw)))
