"""A leaner claim path: receipts keep one B-tree, and the claim and fast-completion
functions name ring children instead of scanning partitioned parents.

Every claimed job appends one receipt, and each B-tree on the receipt table costs an index
insert and its WAL per job on the claim path. After this revision:

* ``lease_claims_stale_idx`` ``(materialized_at, claimed_at, job_id)`` is dropped: stale
  rescue filters on the heartbeat-or-claim time, which it could not serve;
* ``lease_claims_ready_ref_idx`` ``(ready_slot, ready_generation)`` becomes
  ``lease_claims_ready_slot_idx``, a BRIN on ``ready_slot`` (pages_per_range 16) that
  serves the queue-prune gate "open receipts of ready slot k": receipts are appended in
  roughly ready-slot order and the claim ring is small.

Both are statements on the partitioned parent; PostgreSQL applies them to every child.

``claim_ready`` and ``complete_receipts`` (same signatures) are replaced by bodies that read
one ring child per statement (generated per-slot dispatch): in PostgreSQL 15 a cached
generic plan over a partitioned parent locks every child and child index in every
transaction (151 relation locks per claim call before, 28 after).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0004

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0004.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0004.downgrade(revision_shape(kw)))
