"""Operator actions on jobs: retry, cancel, re-prioritise, move, age; and queue options.

Ready rows are never updated: an unclaimed available job is voided with an append-only
tombstone (after taking its lane's claim head lock, so no claim can take it concurrently)
and, when it moves, re-enqueued into its new lane.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, CompoundSelect, Connection, Select, bindparam, func, select

from qstore.schema import StorageSchema
from qstore.schema.queue_plane import WheelResolution, at_lane_position
from qstore.storage import destinations
from qstore.storage.bodies import Body
from qstore.storage.checks import seconds
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination
from qstore.storage.jobs import is_stripe, logical_queue
from qstore.storage.planes import control, execution, queue
from qstore.storage.planes.execution import LIVE, Closure
from qstore.storage.statements import live_deferred, receipt_open
from qstore.types import JobRow, JobState

__all__ = [
    "age_waiting_priorities",
    "cancel_job",
    "cancel_jobs_by_ids",
    "move_queue",
    "retry_job",
    "retry_jobs_by_ids",
    "set_priority",
    "set_queue_options",
]

ORIGINAL_PRIORITY = "_qstore_original_priority"
ORIGINAL_QUEUE = "_qstore_original_queue"


@dataclass(frozen=True)
class AdminReads:
    ready_candidates: Select[Any]
    still_unclaimed: Select[Any]
    live_attempts: CompoundSelect[Any]
    waiting: Select[Any]
    scheduled: Select[Any]
    aging_candidates: Select[Any]


@functools.lru_cache(maxsize=64)
def _reads(sch: StorageSchema) -> AdminReads:
    r = sch.ready.parent
    c, le = sch.claims.parent, sch.leases.parent
    d = live_deferred(sch)
    job = bindparam("b_job", type_=BigInteger())
    tombstoned = queue.ready_tombstoned(sch, r)
    claimed = queue.ready_claimed(sch, r)
    is_open = receipt_open(sch, c)
    key = (r.c.ready_slot == bindparam("k_slot"), r.c.queue == bindparam("k_queue"),
           r.c.priority == bindparam("k_priority"), r.c.enqueue_shard == bindparam("k_shard"),
           r.c.lane_seq == bindparam("k_seq"))
    now = func.clock_timestamp()
    # every unclaimed row waiting that long above the top priority (one ordered pass over the
    # rows and the claim ranges, not a range lookup per row: see unclaimed_ready)
    waited = queue.unclaimed_ready(sch, None, r.c.priority > 1, r.c.run_at <= now - bindparam("interval"),
                                   name="waited")
    return AdminReads(
        ready_candidates=select(r).where(r.c.job_id == job, ~tombstoned).order_by(r.c.lane_seq.desc()),
        still_unclaimed=select(r.c.job_id).where(*key, ~tombstoned, ~claimed),
        live_attempts=select(le.c.job_id, le.c.run_lease).where(le.c.job_id == job, le.c.state.in_(LIVE))
        .union(select(c.c.job_id, c.c.run_lease).where(c.c.job_id == job, is_open)),
        waiting=select(le.c.job_id, le.c.run_lease).where(le.c.job_id == job, le.c.state == JobState.WAITING_EXTERNAL),
        scheduled=select(d).where(d.c.job_id == job, d.c.state == JobState.SCHEDULED),
        aging_candidates=select(r).select_from(r.join(waited, at_lane_position(waited, r)))
        .order_by(r.c.run_at, r.c.job_id).limit(bindparam("limit")),
    )


def _take_available(conn: Connection, sch: StorageSchema, row: Any) -> Body | None:
    """Tombstone ready row ``row`` if it is still unclaimed (checked under its lane's claim
    head lock, so no claim can take it meanwhile). Returns its body, or None."""
    control.lock_lane_head(conn, sch, row.queue, row.priority, row.enqueue_shard)
    if conn.execute(_reads(sch).still_unclaimed, {
            "k_slot": row.ready_slot, "k_queue": row.queue, "k_priority": row.priority,
            "k_shard": row.enqueue_shard, "k_seq": row.lane_seq}).first() is None:
        return None
    queue.tombstone(conn, sch, row)
    return Body.from_ready(row)


def _take_unclaimed(conn: Connection, sch: StorageSchema, job_id: int) -> Body | None:
    for row in conn.execute(_reads(sch).ready_candidates, {"b_job": job_id}).all():
        body = _take_available(conn, sch, row)
        if body is not None:
            return body
    return None


def retry_job(ctx: StorageContext, conn: Connection, job_id: int) -> JobRow | None:
    """Re-enqueue a waiting_external attempt or the newest failed/cancelled terminal row with
    attempt 0 (run_lease kept, payload kept). None when neither exists; a unique key owned
    by another job raises ``UniqueConflictError``."""
    sch = ctx.schema
    waiting = [(r[0], r[1]) for r in conn.execute(_reads(sch).waiting, {"b_job": job_id})]
    if waiting:
        taken = execution.take_attempts(conn, sch, waiting, Closure.RETRIED, (JobState.WAITING_EXTERNAL,))
        if taken:
            t = taken[0]
            return destinations.apply(conn, ctx, [(Body.from_taken(t), Decision(Destination.READY, attempt=0),
                                                   t.old_state)])[0]
    d = sch.done.parent
    rows = conn.execute(queue.select_done_of_job(
        sch, job_id, d.c.state.in_([JobState.FAILED, JobState.CANCELLED]), newest_per_job=True, limit=1)).all()
    if not rows:
        return None
    queue.delete_done(conn, sch, rows)
    body = Body.from_snapshot(rows[0]).replace(attempted_at=None)
    return destinations.apply(conn, ctx, [(body, Decision(Destination.READY, attempt=0), JobState(rows[0].state))])[0]


def _each_in_id_order(ids: Sequence[int], one: Callable[[int], JobRow | None]) -> list[JobRow]:
    """``one(i)`` for each distinct id in ascending order; the rows it returned, in the order
    of ``ids``. Two calls over the same ids take their jobs' locks in the same order, so one
    waits for the other instead of deadlocking with it (calls over different ids that share
    a lane can still meet at the lane's head, which is locked in id order too)."""
    rows = {i: r for i in sorted(set(ids)) if (r := one(i)) is not None}
    return [rows[i] for i in dict.fromkeys(ids) if i in rows]


def retry_jobs_by_ids(ctx: StorageContext, conn: Connection, ids: Sequence[int]) -> list[JobRow]:
    """``retry_job`` for each id, all in one transaction (all-or-nothing on error), taken in
    ascending id order; the retried rows in the order of ``ids``."""
    return _each_in_id_order(ids, lambda i: retry_job(ctx, conn, i))


def cancel_job(ctx: StorageContext, conn: Connection, job_id: int) -> JobRow | None:
    """Cancel whatever is live: an unclaimed ready position (a tombstone and a narrow done
    row beside its ready row), a running/waiting attempt (closed, NOTIFY on the cancel
    channel), or a deferred row.

    A wait that a concurrent promotion took while this looked elsewhere is found where the
    promotion put it: the deferred take waits for the promotion's commit, and the ready
    ring and the attempts are looked at again after it."""
    sch = ctx.schema
    row = _cancel_ready_or_running(ctx, conn, job_id)
    if row is not None:
        return row
    rows = queue.take_deferred(conn, sch, job_id, [JobState.SCHEDULED, JobState.RETRYABLE])
    if rows:
        r = rows[0]
        return destinations.apply(conn, ctx, [(Body.from_snapshot(r), Decision(Destination.TERMINAL, JobState.CANCELLED),
                                               JobState(r.state))])[0]
    return _cancel_ready_or_running(ctx, conn, job_id)


def _cancel_ready_or_running(ctx: StorageContext, conn: Connection, job_id: int) -> JobRow | None:
    """:func:`cancel_job`'s first two places: an unclaimed ready position, then a live
    attempt."""
    sch = ctx.schema
    body = _take_unclaimed(conn, sch, job_id)
    if body is not None:
        return destinations.apply(conn, ctx, [(body, Decision(Destination.TERMINAL, JobState.CANCELLED),
                                               JobState.AVAILABLE)], ready_payloads={})[0]
    pairs = [(p[0], p[1]) for p in conn.execute(_reads(sch).live_attempts, {"b_job": job_id})]
    if pairs:
        taken = execution.take_attempts(conn, sch, pairs, Closure.CANCELLED, LIVE)
        if taken:
            t = taken[0]
            row = destinations.apply(conn, ctx, [(Body.from_taken(t), Decision(
                Destination.TERMINAL, JobState.CANCELLED, error="cancelled by operator"), t.old_state)],
                ready_payloads={t.job_id: t.payload})[0]
            queue.notify(conn, sch.config.cancel_channel, json.dumps({"job_id": t.job_id, "run_lease": t.run_lease}))
            return row
    return None


def cancel_jobs_by_ids(ctx: StorageContext, conn: Connection, ids: Sequence[int]) -> list[JobRow]:
    """``cancel_job`` for each id, all in one transaction, taken in ascending id order (two
    calls over the same jobs do not deadlock each other); the cancelled rows in the order of
    ``ids``."""
    return _each_in_id_order(ids, lambda i: cancel_job(ctx, conn, i))


def _stamp(metadata: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = dict(metadata)
    out.setdefault(key, value)  # first writer wins
    return out


def _target_queue(sch: StorageSchema, current: str, queue_name: str | None, job_id: int) -> str:
    if queue_name is None or queue_name in (current, logical_queue(current)):
        return current
    n = sch.config.queue_stripe_count
    return queue_name if n <= 1 or is_stripe(queue_name) else f"{queue_name}#{job_id % n}"


def _moved(body: Body, queue_was: str, priority_was: int, new_queue: str, new_priority: int) -> Body:
    """``body`` in ``new_queue`` at ``new_priority``; its metadata keeps the original
    priority and (logical) queue it had before its first change of each."""
    meta = body.job.metadata
    if new_priority != priority_was:
        meta = _stamp(meta, ORIGINAL_PRIORITY, priority_was)
    if new_queue != queue_was:
        meta = _stamp(meta, ORIGINAL_QUEUE, logical_queue(queue_was))
    return body.replace(queue=new_queue, priority=new_priority, metadata=meta)


def _move(ctx: StorageContext, conn: Connection, job_id: int, new_queue: str | None, priority: int | None) -> bool:
    """Change queue and/or priority of a scheduled or unclaimed available job. False when
    nothing matched or nothing would change (retryable, running and terminal jobs stay). A
    scheduled job that a concurrent promotion made available is moved where it went."""
    sch = ctx.schema
    s = _reads(sch)
    seen = conn.execute(s.scheduled, {"b_job": job_id}).first()
    if seen is not None:
        new_q = _target_queue(sch, seen.queue, new_queue, job_id)
        new_p = priority if priority is not None else seen.priority
        if new_q == seen.queue and new_p == seen.priority:
            return False
        # the wait ends (its wheel entry marked moved, or its overflow row deleted) and a new
        # one with the new queue and priority is appended, due at the same time
        taken = queue.take_deferred(conn, sch, job_id, [JobState.SCHEDULED], resolution=WheelResolution.MOVED)
        if taken:
            row = taken[0]
            new_q = _target_queue(sch, row.queue, new_queue, job_id)
            new_p = priority if priority is not None else row.priority
            moved = _moved(Body.from_snapshot(row), row.queue, row.priority, new_q, new_p)
            queue.write_deferred(conn, sch, [(moved, JobState.SCHEDULED, row.run_at, row.finalized_at)])
            return True
        # promoted meanwhile (the take waited for the promotion's commit): the job may now be
        # an unclaimed ready position, looked for below (cancelled meanwhile: found nowhere)
    for r in conn.execute(s.ready_candidates, {"b_job": job_id}).all():
        new_q = _target_queue(sch, r.queue, new_queue, job_id)
        new_p = priority if priority is not None else r.priority
        if new_q == r.queue and new_p == r.priority:
            return False
        body = _take_available(conn, sch, r)
        if body is None:
            continue
        moved = _moved(body, r.queue, r.priority, new_q, new_p)
        destinations.apply(conn, ctx, [(moved, Decision(Destination.READY), JobState.AVAILABLE)])
        return True
    return False


def set_priority(ctx: StorageContext, conn: Connection, job_id: int, priority: int) -> bool:
    """Re-prioritise a scheduled or unclaimed available job (its original priority is kept
    in its metadata). False when nothing matched or nothing would change."""
    return _move(ctx, conn, job_id, None, priority)


def move_queue(ctx: StorageContext, conn: Connection, job_id: int, queue: str, priority: int | None = None) -> bool:
    """Move a scheduled or unclaimed available job to ``queue`` (and ``priority``). False
    when nothing matched or nothing would change."""
    return _move(ctx, conn, job_id, queue, priority)


def age_waiting_priorities(ctx: StorageContext, conn: Connection, aging_interval: timedelta | float,
                           limit: int) -> list[int]:
    """Physically lift up to ``limit`` unclaimed ready jobs waiting at least
    ``aging_interval`` one priority level (tombstone + re-enqueue). Returns the moved ids."""
    sch = ctx.schema
    moved: list[int] = []
    for r in conn.execute(_reads(sch).aging_candidates, {"interval": seconds(aging_interval), "limit": limit}).all():
        body = _take_available(conn, sch, r)
        if body is None:
            continue
        lifted = body.replace(priority=r.priority - 1, metadata=_stamp(body.job.metadata, ORIGINAL_PRIORITY, r.priority))
        destinations.apply(conn, ctx, [(lifted, Decision(Destination.READY), JobState.AVAILABLE)])
        moved.append(r.job_id)
    return moved


def set_queue_options(ctx: StorageContext, conn: Connection, queue: str, *, paused: bool | None = None,
                      enqueue_shards: int | None = None, dlq_enabled: bool | None = None) -> None:
    """Upsert the logical queue's ``queue_meta`` row (pause gate, enqueue shards, DLQ policy);
    options left ``None`` keep their value."""
    values: dict[str, Any] = {}
    if paused is not None:
        values.update(paused=paused, paused_at=func.clock_timestamp() if paused else None)
    if enqueue_shards is not None:
        values["enqueue_shards"] = enqueue_shards
    if dlq_enabled is not None:
        values["dlq_enabled"] = dlq_enabled
    control.set_queue_options(conn, ctx.schema, queue, values)
    ctx.lanes.clear()
