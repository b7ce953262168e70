"""Maintenance that moves work along: rescue of stale / overdue / timed-out attempts and
promotion of due deferred jobs.

Rescue closes the old attempt first (closure + lease delete by ``(job_id, run_lease)``), so a
late write from the rescued worker is stale; it respects exhaustion (trap T9): an exhausted
attempt ends failed — or in the DLQ when its queue's policy says so — instead of looping.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Integer, and_, bindparam, delete, func, select
from sqlalchemy.dialects.postgresql import INTERVAL

from qstore.model import JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage.attempts import take_attempts
from qstore.storage.enqueue import LaneRouter
from qstore.storage.jobs import logical_queue
from qstore.storage.statements import attempt_leased, receipt_closed
from qstore.storage.transitions import Decision, apply, dlq_enabled, exhausted
from qstore.storage.writers import Body

__all__ = ["RESCUE_LIMIT", "promote_due", "rescue"]

RESCUE_LIMIT = 500


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    c, cl, le, st, d, m = (sch.claims.parent, sch.closures.parent, sch.leases.parent,
                           sch.attempt_state, sch.deferred, sch.queue_meta)
    now = func.clock_timestamp()
    cutoff = now - bindparam("staleness", type_=INTERVAL())
    closed = receipt_closed(cl, c)
    leased = attempt_leased(le, c)
    st_c = st.alias("st_c")
    st_l = st.alias("st_l")
    limit = bindparam("limit", type_=Integer())
    paused = select(m.c.queue).where(m.c.queue == func.regexp_replace(d.c.queue, "#[0-9]+$", ""), m.c.paused).exists()
    due = (select(d.c.job_id).where(d.c.state == bindparam("state"), d.c.run_at <= now, ~paused)
           .order_by(d.c.run_at, d.c.priority, d.c.job_id).limit(limit).with_for_update(skip_locked=True))
    return {
        "stale_leases": select(le.c.job_id, le.c.run_lease).select_from(
            le.outerjoin(st_l, and_(st_l.c.job_id == le.c.job_id, st_l.c.run_lease == le.c.run_lease)))
        .where(le.c.state == "running", func.coalesce(st_l.c.heartbeat_at, le.c.heartbeat_at, le.c.attempted_at) < cutoff)
        .limit(limit).with_for_update(of=le, skip_locked=True),
        "stale_claims": select(c.c.job_id, c.c.run_lease).select_from(
            c.outerjoin(st_c, and_(st_c.c.job_id == c.c.job_id, st_c.c.run_lease == c.c.run_lease)))
        .where(~closed, ~leased, func.coalesce(st_c.c.heartbeat_at, c.c.claimed_at) < cutoff)
        .limit(limit).with_for_update(of=c, skip_locked=True),
        "overdue_leases": select(le.c.job_id, le.c.run_lease).where(le.c.state == "running", le.c.deadline_at < now)
        .limit(limit).with_for_update(skip_locked=True),
        "overdue_claims": select(c.c.job_id, c.c.run_lease).where(~closed, ~leased, c.c.deadline_at < now)
        .limit(limit).with_for_update(of=c, skip_locked=True),
        "timed_out": select(le.c.job_id, le.c.run_lease).where(
            le.c.state == "waiting_external", le.c.callback_timeout_at < now)
        .limit(limit).with_for_update(skip_locked=True),
        "take_due": delete(d).where(d.c.job_id.in_(due.scalar_subquery())).returning(*d.c),
    }


def _rescue_pairs(conn: Connection, sch: StorageSchema, router: LaneRouter, pairs: Sequence[tuple[int, int]],
                  label: str, error: str, lease_states: Sequence[str]) -> list[JobRow]:
    taken = take_attempts(conn, sch, pairs, label, lease_states)
    if not taken:
        return []
    bodies = [Body.from_taken(t) for t in taken]
    dlq_queues = dlq_enabled(conn, sch, {b.queue for b in bodies if exhausted(b)})
    items = []
    for t, b in zip(taken, bodies, strict=True):
        if not exhausted(b):
            d = Decision("deferred", JobState.RETRYABLE, error=error)
        elif logical_queue(b.queue) in dlq_queues:
            d = Decision("dlq", reason=label, error=error, terminal_error=True)
        else:
            d = Decision("terminal", JobState.FAILED, error=error, terminal_error=True)
        items.append((b, d, t.old_state))
    return apply(conn, sch, router, items, ready_payloads={t.job_id: t.payload for t in taken},
                 unique_conflicts="fail")


def rescue(conn: Connection, sch: StorageSchema, router: LaneRouter, kind: str,
           staleness: timedelta | None = None) -> list[JobRow]:
    """``kind``: "heartbeat" (running attempts silent for ``staleness``), "deadline" (past
    ``deadline_at``) or "callback" (waiting past ``callback_timeout_at``). At most
    ``RESCUE_LIMIT`` attempts per family per call; rows locked by others are skipped."""
    s = _statements(sch)
    arg: dict[str, Any] = {"limit": RESCUE_LIMIT}
    if kind == "heartbeat":
        arg["staleness"] = staleness
        leases = [tuple(r) for r in conn.execute(s["stale_leases"], arg)]
        claims = [tuple(r) for r in conn.execute(s["stale_claims"], arg)]
        return (_rescue_pairs(conn, sch, router, leases, "rescued", "heartbeat stale", ("running",))
                + _rescue_pairs(conn, sch, router, claims, "rescued", "receipt claim stale", ("running",)))
    if kind == "deadline":
        pairs = [tuple(r) for r in conn.execute(s["overdue_leases"], arg)]
        pairs += [tuple(r) for r in conn.execute(s["overdue_claims"], arg)]
        return _rescue_pairs(conn, sch, router, pairs, "deadline_expired", "hard deadline exceeded", ("running",))
    if kind == "callback":
        pairs = [tuple(r) for r in conn.execute(s["timed_out"], arg)]
        return _rescue_pairs(conn, sch, router, pairs, "callback_timeout", "callback timed out", ("waiting_external",))
    raise ValueError(kind)


def promote_due(conn: Connection, sch: StorageSchema, router: LaneRouter, state: JobState, batch_size: int) -> int:
    """Move up to ``batch_size`` due deferred rows of ``state`` (scheduled or retryable) of
    unpaused queues into the ready ring (attempt and run_lease kept); NOTIFY on commit.
    Returns how many became available.

    A job whose unique key another job took meanwhile (its ``unique_states`` released the
    key while it waited) does not become available: it ends ``failed`` with an error entry
    naming the key's owner, and the rest of the batch is promoted (two due jobs of one
    batch wanting the same key: the first in promotion order wins)."""
    if state not in (JobState.SCHEDULED, JobState.RETRYABLE) or batch_size <= 0:
        return 0
    taken = conn.execute(_statements(sch)["take_due"], {"state": state.value, "limit": batch_size}).all()
    if not taken:
        return 0
    rows = sorted(taken, key=lambda r: (r.run_at, r.priority, r.job_id))  # RETURNING keeps no order
    out = apply(conn, sch, router, [(Body.from_snapshot(r), Decision("ready"), state) for r in rows],
                unique_conflicts="fail")
    return sum(1 for r in out if r.state == JobState.AVAILABLE)
