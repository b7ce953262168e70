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

from sqlalchemy import text

from alembic import op
from qstore.migrate import migration_config
from qstore.schema.functions import ServerFunction, declare_functions

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _swap(old: tuple[ServerFunction, ...], new: tuple[ServerFunction, ...]) -> None:
    """Drop the functions of ``old`` whose signature ``new`` does not have, then create or
    replace every function of ``new`` whose body changed."""
    bind = op.get_bind()
    keep = {f.signature for f in new}
    before = {f.signature: f.definition for f in old}
    for f in old:
        if f.signature not in keep:
            bind.execute(text(f.drop_sql()))
    for f in new:
        if before.get(f.signature) != f.definition:
            bind.execute(text(f.create_sql()))


def upgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    _swap(declare_functions(cfg, as_of="0002"), declare_functions(cfg, as_of="0003"))


def downgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    _swap(declare_functions(cfg, as_of="0003"), declare_functions(cfg, as_of="0002"))
