"""Operator actions on jobs: retry, cancel, re-prioritise, move, age.

Ready rows are never updated: an unclaimed available job is voided with an append-only
tombstone (after taking its lane's claim head lock, so no claim can take it concurrently)
and, when it moves, re-enqueued into its new lane.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Connection, bindparam, func, insert, select, update

from qstore.model import JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage import history
from qstore.storage.attempts import take_attempts
from qstore.storage.enqueue import LaneRouter
from qstore.storage.jobs import is_stripe, logical_queue
from qstore.storage.statements import receipt_closed
from qstore.storage.transitions import Decision, apply
from qstore.storage.writers import Body

__all__ = ["age_waiting", "cancel_job", "move_job", "retry_job", "take_available"]

ORIGINAL_PRIORITY = "_qstore_original_priority"
ORIGINAL_QUEUE = "_qstore_original_queue"
LIVE = ("running", "waiting_external")


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    r, t, cr, h = sch.ready.parent, sch.tombstones.parent, sch.claim_ranges.parent, sch.claim_heads
    c, cl, le, d = sch.claims.parent, sch.closures.parent, sch.leases.parent, sch.deferred
    job = bindparam("b_job", type_=BigInteger())
    tombstoned = select(t.c.job_id).where(
        t.c.ready_slot == r.c.ready_slot, t.c.queue == r.c.queue, t.c.priority == r.c.priority,
        t.c.enqueue_shard == r.c.enqueue_shard, t.c.lane_seq == r.c.lane_seq).exists()
    claimed = select(cr.c.first_seq).where(
        cr.c.queue == r.c.queue, cr.c.priority == r.c.priority, cr.c.enqueue_shard == r.c.enqueue_shard,
        cr.c.first_seq <= r.c.lane_seq, cr.c.last_seq >= r.c.lane_seq).exists()
    closed = receipt_closed(cl, c)
    key = lambda x: (x.c.ready_slot == bindparam("k_slot"), x.c.queue == bindparam("k_queue"),  # noqa: E731
                     x.c.priority == bindparam("k_priority"), x.c.enqueue_shard == bindparam("k_shard"),
                     x.c.lane_seq == bindparam("k_seq"))
    now = func.clock_timestamp()
    return {
        "ready_candidates": select(r).where(r.c.job_id == job, ~tombstoned).order_by(r.c.lane_seq.desc()),
        "lock_head": select(h.c.queue).where(h.c.queue == bindparam("k_queue"), h.c.priority == bindparam("k_priority"),
                                             h.c.enqueue_shard == bindparam("k_shard")).with_for_update(),
        "still_unclaimed": select(r.c.job_id).where(*key(r), ~tombstoned, ~claimed),
        "tombstone": insert(t).values(ready_slot=bindparam("k_slot"), ready_generation=bindparam("k_gen"),
                                      queue=bindparam("k_queue"), priority=bindparam("k_priority"),
                                      enqueue_shard=bindparam("k_shard"), lane_seq=bindparam("k_seq"),
                                      job_id=job),
        "live_attempts": select(le.c.job_id, le.c.run_lease).where(le.c.job_id == job, le.c.state.in_(LIVE))
        .union(select(c.c.job_id, c.c.run_lease).where(c.c.job_id == job, ~closed)),
        "waiting": select(le.c.job_id, le.c.run_lease).where(le.c.job_id == job, le.c.state == "waiting_external"),
        "take_deferred": d.delete().where(d.c.job_id == job, d.c.state.in_(bindparam("states", expanding=True)))
        .returning(*d.c),
        "lock_scheduled": select(d).where(d.c.job_id == job, d.c.state == "scheduled").with_for_update(skip_locked=True),
        "update_scheduled": update(d).where(d.c.job_id == job).values(
            queue=bindparam("n_queue"), priority=bindparam("n_priority"), payload=bindparam("n_payload")),
        "aging_candidates": select(r).where(r.c.priority > 1, r.c.run_at <= now - bindparam("interval"),
                                            ~tombstoned, ~claimed).order_by(r.c.run_at, r.c.job_id).limit(bindparam("limit")),
    }


def _ready_key(row: Any) -> dict[str, Any]:
    return {"k_slot": row.ready_slot, "k_gen": row.ready_generation, "k_queue": row.queue,
            "k_priority": row.priority, "k_shard": row.enqueue_shard, "k_seq": row.lane_seq}


def take_available(conn: Connection, sch: StorageSchema, row: Any) -> Body | None:
    """Tombstone ready row ``row`` if it is still unclaimed (checked under its lane's claim
    head lock, so no claim can take it meanwhile). Returns its body, or None."""
    s = _statements(sch)
    k = _ready_key(row)
    conn.execute(s["lock_head"], k).first()
    if conn.execute(s["still_unclaimed"], k).first() is None:
        return None
    conn.execute(s["tombstone"], {**k, "b_job": row.job_id})
    p = row.payload or {}
    return Body(job_id=row.job_id, kind=row.kind, queue=row.queue, args=row.args, priority=row.priority,
                attempt=row.attempt, run_lease=row.run_lease, max_attempts=row.max_attempts,
                run_at=row.run_at, created_at=row.created_at, unique_key=row.unique_key,
                unique_states=row.unique_states, metadata=dict(p.get("metadata") or {}),
                tags=list(p.get("tags") or []), errors=list(p.get("errors") or []),
                progress=p.get("progress"), attempted_at=row.attempted_at,
                ready_slot=row.ready_slot, ready_generation=row.ready_generation,
                enqueue_shard=row.enqueue_shard, lane_seq=row.lane_seq)


def _take_unclaimed(conn: Connection, sch: StorageSchema, job_id: int) -> Body | None:
    for row in conn.execute(_statements(sch)["ready_candidates"], {"b_job": job_id}).all():
        body = take_available(conn, sch, row)
        if body is not None:
            return body
    return None


def retry_job(conn: Connection, sch: StorageSchema, router: LaneRouter, job_id: int) -> JobRow | None:
    """Re-enqueue a waiting_external attempt or the newest failed/cancelled terminal row with
    attempt 0 (run_lease kept, payload kept). None when neither exists."""
    waiting = conn.execute(_statements(sch)["waiting"], {"b_job": job_id}).all()
    if waiting:
        taken = take_attempts(conn, sch, [tuple(w) for w in waiting], "retried", ("waiting_external",))
        if taken:
            t = taken[0]
            return apply(conn, sch, router, [(Body.from_taken(t), Decision("ready", attempt=0), t.old_state)])[0]
    d = sch.done.parent
    rows = conn.execute(history.select_done(
        sch, d.c.job_id == job_id, d.c.state.in_(["failed", "cancelled"]), newest_per_job=True, limit=1)).all()
    if not rows:
        return None
    history.delete_done(conn, sch, rows)
    body = replace(history.done_bodies(rows)[0], attempted_at=None)
    return apply(conn, sch, router, [(body, Decision("ready", attempt=0), JobState(rows[0].state))])[0]


def cancel_job(conn: Connection, sch: StorageSchema, router: LaneRouter, job_id: int) -> JobRow | None:
    """Cancel whatever is live: an unclaimed ready position (tombstone + wide done row), a
    running/waiting attempt (closed, NOTIFY on the cancel channel), or a deferred row."""
    body = _take_unclaimed(conn, sch, job_id)
    if body is not None:
        wide = replace(body, ready_slot=body.ready_slot)  # keeps its own ring keys
        return apply(conn, sch, router, [(wide, Decision("terminal", JobState.CANCELLED), JobState.AVAILABLE)],
                     ready_payloads={})[0]
    s = _statements(sch)
    pairs = [tuple(p) for p in conn.execute(s["live_attempts"], {"b_job": job_id})]
    if pairs:
        taken = take_attempts(conn, sch, pairs, "cancelled", LIVE)
        if taken:
            t = taken[0]
            row = apply(conn, sch, router, [(Body.from_taken(t), Decision("terminal", JobState.CANCELLED,
                                                                           error="cancelled by operator"), t.old_state)],
                        ready_payloads={t.job_id: t.payload})[0]
            conn.execute(select(func.pg_notify(sch.config.cancel_channel,
                                               json.dumps({"job_id": t.job_id, "run_lease": t.run_lease}))))
            return row
    rows = conn.execute(s["take_deferred"], {"b_job": job_id, "states": ["scheduled", "retryable"]}).all()
    if rows:
        r = rows[0]
        return apply(conn, sch, router, [(Body.from_snapshot(r), Decision("terminal", JobState.CANCELLED),
                                          JobState(r.state))])[0]
    return None


def _stamp(metadata: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = dict(metadata)
    out.setdefault(key, value)  # first writer wins
    return out


def _target_queue(sch: StorageSchema, current: str, queue: str | None, job_id: int) -> str:
    if queue is None or queue in (current, logical_queue(current)):
        return current
    n = sch.config.queue_stripe_count
    return queue if n <= 1 or is_stripe(queue) else f"{queue}#{job_id % n}"


def move_job(conn: Connection, sch: StorageSchema, router: LaneRouter, job_id: int,
             queue: str | None, priority: int | None) -> bool:
    """Change queue and/or priority of a scheduled or unclaimed available job. False when
    nothing matched or nothing would change (retryable, running and terminal jobs stay)."""
    s = _statements(sch)
    row = conn.execute(s["lock_scheduled"], {"b_job": job_id}).first()
    if row is not None:
        new_q = _target_queue(sch, row.queue, queue, job_id)
        new_p = priority if priority is not None else row.priority
        if new_q == row.queue and new_p == row.priority:
            return False
        body = Body.from_snapshot(row)
        meta = body.metadata
        if new_p != row.priority:
            meta = _stamp(meta, ORIGINAL_PRIORITY, row.priority)
        if new_q != row.queue:
            meta = _stamp(meta, ORIGINAL_QUEUE, logical_queue(row.queue))
        conn.execute(s["update_scheduled"], {"b_job": job_id, "n_queue": new_q, "n_priority": new_p,
                                              "n_payload": replace(body, metadata=meta).payload})
        return True
    for r in conn.execute(s["ready_candidates"], {"b_job": job_id}).all():
        new_q = _target_queue(sch, r.queue, queue, job_id)
        new_p = priority if priority is not None else r.priority
        if new_q == r.queue and new_p == r.priority:
            return False
        taken = take_available(conn, sch, r)
        if taken is None:
            continue
        body = taken
        meta = body.metadata
        if new_p != r.priority:
            meta = _stamp(meta, ORIGINAL_PRIORITY, r.priority)
        if new_q != r.queue:
            meta = _stamp(meta, ORIGINAL_QUEUE, logical_queue(r.queue))
        moved = replace(body, queue=new_q, priority=new_p, metadata=meta)
        apply(conn, sch, router, [(moved, Decision("ready"), JobState.AVAILABLE)])
        return True
    return False


def age_waiting(conn: Connection, sch: StorageSchema, router: LaneRouter, interval: timedelta, limit: int) -> list[int]:
    """Physically lift up to ``limit`` unclaimed ready jobs waiting ≥ ``interval`` one
    priority level (tombstone + re-enqueue). Returns the moved job ids."""
    moved: list[int] = []
    for r in conn.execute(_statements(sch)["aging_candidates"], {"interval": interval, "limit": limit}).all():
        body = take_available(conn, sch, r)
        if body is None:
            continue
        lifted = replace(body, priority=r.priority - 1, metadata=_stamp(body.metadata, ORIGINAL_PRIORITY, r.priority))
        apply(conn, sch, router, [(lifted, Decision("ready"), JobState.AVAILABLE)])
        moved.append(r.job_id)
    return moved


