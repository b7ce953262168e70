"""The dead-letter queue: moving failed history in, retrying and discarding out of it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, select, tuple_

from qstore.errors import ValidationError
from qstore.model import JobRow, JobState, ListDlqFilter, RetryFromDlqOpts
from qstore.schema import StorageSchema
from qstore.storage import history, unique
from qstore.storage.claim import stripes_for
from qstore.storage.enqueue import LaneRouter
from qstore.storage.jobs import validate_priority, validate_queue
from qstore.storage.transitions import Decision, apply
from qstore.storage.writers import Body, job_row, now, write_dlq

__all__ = ["bulk_move_failed", "bulk_retry", "discard_failed_by_kind", "move_failed", "retry_from_dlq"]


def _move(conn: Connection, sch: StorageSchema, rows: Sequence[Any], reason: str) -> list[JobRow]:
    if not rows:
        return []
    history.delete_done(conn, sch, rows)
    bodies = history.done_bodies(rows)
    at = now(conn)
    write_dlq(conn, sch, [(b, reason, b.run_lease) for b in bodies], at)
    return [job_row(b, JobState.FAILED, finalized_at=at) for b in bodies]


def move_failed(conn: Connection, sch: StorageSchema, job_id: int, reason: str) -> JobRow | None:
    d = sch.done.parent
    rows = conn.execute(history.select_done(sch, d.c.job_id == job_id, d.c.state == "failed",
                                            newest_per_job=True, limit=1)).all()
    moved = _move(conn, sch, rows, reason)
    return moved[0] if moved else None


def bulk_move_failed(conn: Connection, sch: StorageSchema, kind: str | None, queue: str | None, reason: str) -> int:
    d = sch.done.parent
    where = [d.c.state == "failed"]
    if kind is not None:
        where.append(d.c.kind == kind)
    if queue is not None:
        where.append(d.c.queue.in_(stripes_for(queue, sch.config.queue_stripe_count, 0)))
    rows = conn.execute(history.select_done(sch, *where)).all()
    # one DLQ row per job: keep the newest failed row of each job
    newest: dict[int, Any] = {}
    for r in rows:
        if r.job_id not in newest or r.finalized_at > newest[r.job_id].finalized_at:
            newest[r.job_id] = r
    return len(_move(conn, sch, list(newest.values()), reason))


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    q = sch.dlq
    return {"take": q.delete().where(q.c.job_id == bindparam("job_id")).returning(*q.c)}


def _retry_rows(conn: Connection, sch: StorageSchema, router: LaneRouter, rows: Sequence[Any],
                opts: RetryFromDlqOpts) -> list[JobRow]:
    at = now(conn)
    items = []
    for r in rows:
        body = replace(Body.from_snapshot(r), attempt=0, progress=None, attempted_at=None)
        if opts.queue is not None:
            body = replace(body, queue=opts.queue)
        if opts.priority is not None:
            body = replace(body, priority=opts.priority)
        if opts.run_at is not None and opts.run_at > at:
            d = Decision("deferred", JobState.SCHEDULED, delay=opts.run_at - at, clear_progress=True)
        else:
            d = Decision("ready", clear_progress=True)
        items.append((body, d, JobState.FAILED))
    return apply(conn, sch, router, items)


def retry_from_dlq(conn: Connection, sch: StorageSchema, router: LaneRouter, job_id: int,
                   opts: RetryFromDlqOpts) -> JobRow | None:
    """Take the DLQ row and re-insert the job (attempt 0, run_lease kept, progress cleared);
    a future ``run_at`` schedules it. A unique conflict raises and (the caller rolling back)
    keeps the DLQ row."""
    if opts.queue is not None:
        validate_queue(opts.queue)
    if opts.priority is not None:
        validate_priority(opts.priority)
    if opts.run_at is not None and (not isinstance(opts.run_at, datetime) or opts.run_at.tzinfo is None):
        raise ValidationError("run_at", opts.run_at, "must be a timezone-aware datetime")
    rows = conn.execute(_statements(sch)["take"], {"job_id": job_id}).all()
    if not rows:
        return None
    return _retry_rows(conn, sch, router, rows, opts)[0]


def bulk_retry(conn: Connection, sch: StorageSchema, router: LaneRouter, flt: ListDlqFilter) -> int:
    """Retry every DLQ row matching the filter (at least one criterion required), oldest
    first, at most ``limit`` rows when given. All-or-nothing on a unique conflict."""
    if all(getattr(flt, f) is None for f in ("kind", "queue", "tag", "before_id", "before_dlq_at")):
        raise ValidationError("filter", flt, "bulk_retry_from_dlq needs at least one filter")
    if flt.limit is not None and (not isinstance(flt.limit, int) or flt.limit <= 0):
        raise ValidationError("filter.limit", flt.limit, "must be a positive integer")
    q = sch.dlq
    where = []
    if flt.kind is not None:
        where.append(q.c.kind == flt.kind)
    if flt.queue is not None:
        where.append(q.c.queue.in_(stripes_for(flt.queue, sch.config.queue_stripe_count, 0)))
    if flt.tag is not None:
        where.append(q.c.payload["tags"].contains([flt.tag]))
    if flt.before_id is not None and flt.before_dlq_at is not None:
        where.append(tuple_(q.c.dlq_at, q.c.job_id) < tuple_(flt.before_dlq_at, flt.before_id))
    elif flt.before_id is not None:
        where.append(q.c.job_id < flt.before_id)
    elif flt.before_dlq_at is not None:
        where.append(q.c.dlq_at < flt.before_dlq_at)
    pick = select(q.c.job_id).where(*where).order_by(q.c.dlq_at, q.c.job_id).with_for_update(skip_locked=True)
    if flt.limit is not None:
        pick = pick.limit(flt.limit)
    rows = conn.execute(q.delete().where(q.c.job_id.in_(pick.scalar_subquery())).returning(*q.c)).all()
    return len(_retry_rows(conn, sch, router, rows, RetryFromDlqOpts()))


def discard_failed_by_kind(conn: Connection, sch: StorageSchema, kind: str) -> int:
    """Delete failed terminal rows (-1 deltas) and DLQ rows of ``kind``; release their keys."""
    d, q = sch.done.parent, sch.dlq
    rows = conn.execute(history.select_done(sch, d.c.state == "failed", d.c.kind == kind)).all()
    history.delete_done(conn, sch, rows)
    dl = conn.execute(q.delete().where(q.c.kind == kind).returning(q.c.job_id, q.c.unique_key)).all()
    unique.release(conn, sch, [(r.unique_key, r.job_id) for r in rows if r.unique_key is not None]
                   + [(r.unique_key, r.job_id) for r in dl if r.unique_key is not None])
    return len(rows) + len(dl)


