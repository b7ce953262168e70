"""Upkeep of the deferred wheel: overflow rows move into the wheel as they come within its
span, and a slot whose buckets are over is reclaimed by ``TRUNCATE`` once every entry in it
is resolved.

Guarantees
----------
* **Nothing here updates a row.** Entries and marks are only appended; a slot is emptied by
  one ``TRUNCATE`` of its wheel and marks children. The one delete is an overflow row's,
  when it moves into the wheel (once per wait due beyond the span).
* **Only resolved entries are truncated.** The prune looks only at the
  ``WHEEL_GUARD_SLOTS`` slots behind the current bucket (no new entry is routed there:
  ``wheel_bucket`` clamps a past ``run_at`` to the current bucket and sends a wait beyond
  the span to the overflow), takes ``lock_timeout = 50ms`` + ``ACCESS EXCLUSIVE`` on both
  children, and only then checks that no entry lacks a mark: every entry committed before
  the lock is visible to that check, and a writer still inside its statement holds the
  child and makes the lock wait. A slot with an unresolved entry (a paused queue's due job)
  waits for a later prune; a lock timeout gives up quietly (``blocked``).
"""

from __future__ import annotations

import functools
from datetime import datetime

from sqlalchemy import Connection

from qstore.config import WHEEL_GUARD_SLOTS, WHEEL_SLOTS
from qstore.storage.context import StorageContext
from qstore.storage.planes import queue
from qstore.storage.targets import Blocked, guarded
from qstore.types import WheelPrune

__all__ = ["advance_overflow", "prune_wheel"]


def advance_overflow(ctx: StorageContext, conn: Connection, batch_size: int) -> int:
    """Move up to ``batch_size`` overflow rows (``deferred_jobs``) whose ``run_at`` has come
    within the wheel's span into the wheel, earliest first; rows locked by others are
    skipped. Returns how many moved (0 for a ``batch_size`` of 0 or less)."""
    if batch_size <= 0:
        return 0
    return queue.advance_overflow(conn, ctx.schema, batch_size)


def _prune_slot(conn: Connection, *, ctx: StorageContext, slot: int) -> bool:
    sch = ctx.schema
    if queue.wheel_slot_unresolved(conn, sch, slot):
        return False  # checked before the lock too: a waiting slot queues no exclusive request
    queue.lock_wheel_slot(conn, sch, slot)
    if queue.wheel_slot_unresolved(conn, sch, slot):
        return False
    queue.truncate_wheel_slot(conn, sch, slot)
    return True


def prune_wheel(ctx: StorageContext, conn: Connection, at: datetime | None = None) -> WheelPrune:
    """Truncate each of the ``WHEEL_GUARD_SLOTS`` wheel slots behind the current bucket
    (on the server's clock, or the bucket of ``at``) that was written since it was last
    truncated and whose every entry is resolved. Reports the slots truncated, the slots
    left waiting for an unresolved entry and the slots whose lock was not granted within
    50 ms."""
    sch = ctx.schema
    current = queue.wheel_bucket_now(conn, sch, at)
    pruned: list[int] = []
    waiting: list[int] = []
    blocked: list[int] = []
    for back in range(1, WHEEL_GUARD_SLOTS + 1):
        slot = (current - back) % WHEEL_SLOTS
        if not queue.wheel_slot_written(conn, sch, slot):
            continue
        result = guarded(conn, functools.partial(_prune_slot, ctx=ctx, slot=slot))
        if isinstance(result, Blocked):
            blocked.append(slot)
        elif result:
            pruned.append(slot)
        else:
            waiting.append(slot)
    return WheelPrune(pruned=tuple(pruned), waiting=tuple(waiting), blocked=tuple(blocked))
