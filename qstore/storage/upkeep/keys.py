"""Upkeep of unique keys: released claims are deleted while the MVCC horizon is not pinned.

Releasing a key appends a ``job_unique_releases`` row and deletes nothing (a delete would be
a dead tuple per released key for as long as a snapshot pins the horizon). The released
claim rows and their release rows stay until :func:`purge_released_keys` deletes them,
which it does only while no snapshot of this database is older than ``pinned_after``
(default 5 s, as the counter rollup): then the dead tuples it leaves can be vacuumed.
Seeing other sessions' snapshots requires superuser or ``pg_read_all_stats``; a role
without it does not see a pin and purges anyway (correct, only not free of dead tuples).
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection

from qstore.errors import ValidationError
from qstore.storage.context import StorageContext
from qstore.storage.planes import control
from qstore.storage.upkeep.counters import PINNED_AFTER, mvcc_horizon_pinned

__all__ = ["purge_released_keys"]


def purge_released_keys(ctx: StorageContext, conn: Connection, *, pinned_after: timedelta | None = None) -> int:
    """Delete every released unique claim and its release row (and release rows whose claim
    was taken again since), unless another client backend of this database has held a
    snapshot for longer than ``pinned_after``; returns the number of claims deleted (0
    while the horizon is pinned: nothing is touched). A key's ownership reads the same
    before and after: a released claim is free either way."""
    if pinned_after is None:
        pinned_after = PINNED_AFTER
    elif not isinstance(pinned_after, timedelta) or pinned_after < timedelta(0):
        raise ValidationError("pinned_after", pinned_after, "must be a non-negative timedelta")
    if mvcc_horizon_pinned(conn, pinned_after):
        return 0
    return control.purge_released_keys(conn, ctx.schema)
