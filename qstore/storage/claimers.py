"""Bounded claimers: on a hot queue only a few instances hit the claim path at once.

A claimer slot never owns jobs; it only rations who may call claim. Slots are rows of
``queue_claimer_leases`` (warm table, HOT-friendly); the shared adaptive target lives in
``queue_claimer_state`` and is recomputed from the cheap availability signal at most every
``TARGET_REFRESH``.
"""

from __future__ import annotations

import functools
import time
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, literal, or_, select, update
from sqlalchemy.dialects.postgresql import INTERVAL, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.types import Integer, SmallInteger, Text

from qstore.errors import ValidationError
from qstore.model import QueueClaimerLease
from qstore.schema import StorageSchema
from qstore.storage.claim import stripes_for

__all__ = [
    "MAX_CLAIMERS", "acquire", "adaptive_target", "desired_target", "mark_active", "validate_duration",
    "validate_lease", "validate_max_claimers",
]

TARGET_REFRESH = timedelta(milliseconds=500)
#: Claimer slots are ``smallint``: slot numbers run from 0 to ``max_claimers - 1``.
MAX_CLAIMERS = 32767
_ONE_DAY = timedelta(days=1)


def validate_duration(value: object, field: str) -> timedelta:
    """A strictly positive duration of at most one day (timedelta or seconds)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        # range-checked as a number first: NaN and huge values never reach timedelta()
        if not 0 < value <= _ONE_DAY.total_seconds():
            raise ValidationError(field, value, "must be a positive duration of at most one day")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0) or value > _ONE_DAY:
        raise ValidationError(field, value, "must be a positive duration of at most one day")
    return value


def validate_max_claimers(value: object, field: str = "max_claimers") -> int:
    """An integer of at most ``MAX_CLAIMERS`` (0 or less means: claim nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value > MAX_CLAIMERS:
        raise ValidationError(field, value, f"must be an integer of at most {MAX_CLAIMERS}")
    return value


def validate_lease(lease: object, field: str = "lease") -> QueueClaimerLease:
    """A lease as returned by :func:`acquire` (slot and epoch in their column ranges)."""
    if not isinstance(lease, QueueClaimerLease):
        raise ValidationError(field, lease, "expected a QueueClaimerLease")
    slot, epoch = lease.claimer_slot, lease.lease_epoch
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < MAX_CLAIMERS:
        raise ValidationError(f"{field}.claimer_slot", slot, f"must be an integer between 0 and {MAX_CLAIMERS - 1}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ValidationError(f"{field}.lease_epoch", epoch, "must be a non-negative 64-bit integer")
    return lease


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    t, st, h = sch.claimer_leases, sch.claimer_state, sch.claim_heads
    now = func.clock_timestamp()
    q = bindparam("q_name", type_=Text())
    me = bindparam("me", type_=UUID(as_uuid=True))
    slot = bindparam("q_slot", type_=SmallInteger())
    ttl = bindparam("ttl", type_=INTERVAL())
    idle = bindparam("idle", type_=INTERVAL())
    last = lambda seq: func.coalesce(func.pg_sequence_last_value(seq), 0)  # noqa: E731
    return {
        "owned": select(t.c.claimer_slot, t.c.lease_epoch).where(
            t.c.queue == q, t.c.owner_instance_id == me, t.c.expires_at > now,
            t.c.claimer_slot < bindparam("max", type_=Integer())).order_by(t.c.claimer_slot).limit(1),
        "take": update(t).where(
            t.c.queue == q, t.c.claimer_slot == slot,
            or_(t.c.owner_instance_id == me, t.c.expires_at <= now, t.c.last_claimed_at <= now - idle),
        ).values(
            lease_epoch=t.c.lease_epoch + case((t.c.owner_instance_id != me, 1), else_=0),
            owner_instance_id=me, leased_at=now, last_claimed_at=now, expires_at=now + ttl,
        ).returning(t.c.claimer_slot, t.c.lease_epoch),
        "insert": pg_insert(t).values(
            queue=q, claimer_slot=slot, owner_instance_id=me, lease_epoch=0, leased_at=now,
            last_claimed_at=now, expires_at=now + ttl,
        ).on_conflict_do_nothing().returning(t.c.claimer_slot, t.c.lease_epoch),
        "mark": update(t).where(
            t.c.queue == q, t.c.claimer_slot == slot, t.c.owner_instance_id == me,
            t.c.lease_epoch == bindparam("q_epoch"),
        ).values(last_claimed_at=now, expires_at=now + ttl),
        "needs_refresh": select(or_(t.c.last_claimed_at <= now - idle, t.c.expires_at <= now + ttl)).where(
            t.c.queue == q, t.c.claimer_slot == slot, t.c.owner_instance_id == me),
        "state": select(st.c.target_claimers, st.c.updated_at > now - literal(TARGET_REFRESH, INTERVAL())).where(st.c.queue == q),
        "available": select(func.coalesce(func.sum(func.greatest(last(h.c.enqueue_seq) - last(h.c.claim_seq), 0)), 0))
        .where(h.c.queue.in_(bindparam("queues", expanding=True))),
        "upsert_state": pg_insert(st).values(queue=q, target_claimers=bindparam("q_target", type_=SmallInteger()),
                                             updated_at=now),
    }


def acquire(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID, max_claimers: int,
            lease_ttl: timedelta, idle_threshold: timedelta) -> QueueClaimerLease | None:
    """Keep this instance's unexpired slot, else take over an expired/idle one (epoch + 1
    on owner change) or insert a free one; None when every slot is busy."""
    if max_claimers <= 0:
        return None
    s = _statements(sch)
    base = {"q_name": queue, "me": instance_id}
    row = conn.execute(s["owned"], {**base, "max": max_claimers}).first()
    if row is not None:
        return QueueClaimerLease(row.claimer_slot, row.lease_epoch)
    start = (instance_id.int ^ int(time.time() * 1000)) % max_claimers
    args = {**base, "ttl": lease_ttl, "idle": idle_threshold}
    for i in range(max_claimers):
        slot = (start + i) % max_claimers
        row = conn.execute(s["take"], {**args, "q_slot": slot}).first()
        if row is None:
            row = conn.execute(s["insert"], {**args, "q_slot": slot}).first()
        if row is not None:
            return QueueClaimerLease(row.claimer_slot, row.lease_epoch)
    return None


def mark_active(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID,
                lease: QueueClaimerLease, lease_ttl: timedelta) -> bool:
    """Refresh the slot if slot, owner and epoch still match (False = the slot was lost)."""
    res = conn.execute(_statements(sch)["mark"], {
        "q_name": queue, "q_slot": lease.claimer_slot, "me": instance_id, "q_epoch": lease.lease_epoch,
        "ttl": lease_ttl,
    })
    return res.rowcount == 1


def needs_refresh(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID,
                  lease: QueueClaimerLease, lease_ttl: timedelta, idle_threshold: timedelta) -> bool:
    return bool(conn.execute(_statements(sch)["needs_refresh"], {
        "q_name": queue, "q_slot": lease.claimer_slot, "me": instance_id,
        "idle": idle_threshold / 2, "ttl": lease_ttl / 2,
    }).scalar())


def desired_target(current: int, available: int, max_claimers: int) -> int:
    """Hysteresis on the current target (thresholds of STORAGE.md §7.3)."""
    if current >= 4:
        want = 4 if available >= 16 else 2 if available >= 4 else 1
    elif current >= 2:
        want = 4 if available >= 64 else 2 if available >= 2 else 1
    else:
        want = 4 if available >= 32 else 2 if available >= 4 else 1
    return max(1, min(want, max_claimers))


def adaptive_target(conn: Connection, sch: StorageSchema, queue: str, max_claimers: int) -> int:
    """The shared claimer target for ``queue``: the stored one while fresh, else recomputed
    from Σ(enqueue - claim cursor) and upserted (one refresher wins)."""
    s = _statements(sch)
    row = conn.execute(s["state"], {"q_name": queue}).first()
    if row is not None and row[1]:
        return max(1, min(int(row[0]), max_claimers))
    available = int(conn.execute(s["available"], {
        "queues": stripes_for(queue, sch.config.queue_stripe_count, 0)}).scalar_one())
    target = desired_target(int(row[0]) if row is not None else 1, available, max_claimers)
    st = sch.claimer_state
    stmt = s["upsert_state"]
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[st.c.queue],
        set_={"target_claimers": stmt.excluded.target_claimers, "updated_at": stmt.excluded.updated_at},
        where=st.c.updated_at <= func.clock_timestamp() - literal(TARGET_REFRESH, INTERVAL()),
    ), {"q_name": queue, "q_target": target})
    return target
