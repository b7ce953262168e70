"""The dead-letter queue: moving failed history in, listing it, retrying and discarding
(or purging) out of it.

The DLQ sits outside terminal history: a job moved in leaves ``done_entries`` (a -1 delta,
so ``queue_counts().terminal`` drops by one) and a job that leaves it by purge or discard is
gone for good, its unique key released. Once its DLQ row is gone, ``load_job`` returns None
for it (the job's earlier ready rows stay in the queue ring until prune, but a claimed ready
row is never shown as available).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, tuple_

from qstore.errors import ValidationError
from qstore.storage import destinations
from qstore.storage.bodies import Body, job_row
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination
from qstore.storage.jobs import stripes_for
from qstore.storage.planes import control
from qstore.storage.planes import queue as queue_plane
from qstore.storage.read import snapshot_row
from qstore.types import DlqEntry, JobRow, JobState, ListDlqFilter, RetryFromDlqOpts

__all__ = ["bulk_move_failed_to_dlq", "bulk_retry_from_dlq", "discard_failed_by_kind", "list_dlq",
           "load_dlq_entry", "move_failed_to_dlq", "purge_dlq", "retry_from_dlq"]


def _move(ctx: StorageContext, conn: Connection, rows: Sequence[Any], reason: str) -> list[JobRow]:
    if not rows:
        return []
    sch = ctx.schema
    queue_plane.delete_done(conn, sch, rows)
    bodies = [Body.from_snapshot(r) for r in rows]
    at = destinations.now(conn)
    queue_plane.write_dlq(conn, sch, [(b, reason, b.job.run_lease) for b in bodies], at)
    return [job_row(b, JobState.FAILED, finalized_at=at) for b in bodies]


def move_failed_to_dlq(ctx: StorageContext, conn: Connection, job_id: int, dlq_reason: str) -> JobRow | None:
    """Move the job's newest failed terminal row into the DLQ; None when it has none."""
    sch = ctx.schema
    d = sch.done.parent
    rows = conn.execute(queue_plane.select_done_of_job(sch, job_id, d.c.state == JobState.FAILED,
                                                       newest_per_job=True, limit=1)).all()
    moved = _move(ctx, conn, rows, dlq_reason)
    return moved[0] if moved else None


def bulk_move_failed_to_dlq(ctx: StorageContext, conn: Connection, kind: str | None, queue: str | None,
                            dlq_reason: str) -> int:
    """Move every failed terminal row (of ``kind`` and/or ``queue`` when given) into the
    DLQ, one row per job (its newest); returns how many jobs moved."""
    sch = ctx.schema
    d = sch.done.parent
    where = [d.c.state == JobState.FAILED]
    if kind is not None:
        where.append(d.c.kind == kind)
    if queue is not None:
        where.append(d.c.queue.in_(stripes_for(queue, sch.config.queue_stripe_count)))
    rows = conn.execute(queue_plane.select_done(sch, *where)).all()
    newest: dict[int, Any] = {}
    for r in rows:
        if r.job_id not in newest or r.finalized_at > newest[r.job_id].finalized_at:
            newest[r.job_id] = r
    return len(_move(ctx, conn, list(newest.values()), dlq_reason))


def _retry_rows(ctx: StorageContext, conn: Connection, rows: Sequence[Any], opts: RetryFromDlqOpts) -> list[JobRow]:
    at = destinations.now(conn)
    items = []
    for r in rows:
        body = Body.from_snapshot(r).replace(attempt=0, progress=None, attempted_at=None)
        if opts.queue is not None:
            body = body.replace(queue=opts.queue)
        if opts.priority is not None:
            body = body.replace(priority=opts.priority)
        if opts.run_at is not None and opts.run_at > at:
            d = Decision(Destination.DEFERRED, JobState.SCHEDULED, delay=opts.run_at - at, clear_progress=True)
        else:
            d = Decision(Destination.READY, clear_progress=True)
        items.append((body, d, JobState.FAILED))
    return destinations.apply(conn, ctx, items)


def retry_from_dlq(ctx: StorageContext, conn: Connection, job_id: int,
                   opts: RetryFromDlqOpts | None = None) -> JobRow | None:
    """Take the DLQ row and re-insert the job (attempt 0, run_lease kept, progress cleared);
    a future ``run_at`` schedules it. A unique conflict raises and leaves the DLQ row."""
    rows = queue_plane.take_dlq(conn, ctx.schema, job_id)
    if not rows:
        return None
    return _retry_rows(ctx, conn, rows, opts or RetryFromDlqOpts())[0]


def _matching(ctx: StorageContext, flt: ListDlqFilter) -> list[Any]:
    """The WHERE criteria of ``flt`` on ``dlq_entries`` (kind, logical queue, tag and the
    ``(dlq_at, job_id)`` keyset bound; ``limit`` is the caller's)."""
    sch = ctx.schema
    q = sch.dlq
    where: list[Any] = []
    if flt.kind is not None:
        where.append(q.c.kind == flt.kind)
    if flt.queue is not None:
        where.append(q.c.queue.in_(stripes_for(flt.queue, sch.config.queue_stripe_count)))
    if flt.tag is not None:
        where.append(q.c.payload["tags"].contains([flt.tag]))
    if flt.before_id is not None and flt.before_dlq_at is not None:
        where.append(tuple_(q.c.dlq_at, q.c.job_id) < tuple_(flt.before_dlq_at, flt.before_id))
    elif flt.before_id is not None:
        where.append(q.c.job_id < flt.before_id)
    elif flt.before_dlq_at is not None:
        where.append(q.c.dlq_at < flt.before_dlq_at)
    return where


def bulk_retry_from_dlq(ctx: StorageContext, conn: Connection, filter: ListDlqFilter) -> int:
    """Retry every DLQ row matching the filter (at least one criterion required), oldest
    first, at most ``limit`` rows when given. All-or-nothing on a unique conflict."""
    flt = filter
    if all(getattr(flt, f) is None for f in ("kind", "queue", "tag", "before_id", "before_dlq_at")):
        raise ValidationError("filter", flt, "bulk_retry_from_dlq needs at least one filter")
    sch = ctx.schema
    q = sch.dlq
    pick = (select(q.c.job_id).where(*_matching(ctx, flt)).order_by(q.c.dlq_at, q.c.job_id)
            .with_for_update(skip_locked=True))
    if flt.limit is not None:
        pick = pick.limit(flt.limit)
    rows = queue_plane.take_dlq_where(conn, sch, pick)
    return len(_retry_rows(ctx, conn, rows, RetryFromDlqOpts()))


def _entry(row: Any) -> DlqEntry:
    return DlqEntry(job=snapshot_row(row), dlq_reason=row.dlq_reason, dlq_at=row.dlq_at,
                    original_run_lease=row.original_run_lease)


def list_dlq(ctx: StorageContext, conn: Connection, filter: ListDlqFilter | None = None) -> list[DlqEntry]:
    """DLQ rows matching ``filter`` (every row without one), newest first by ``(dlq_at,
    job_id)``; at most ``filter.limit`` rows. The next page is the rows before the last one
    returned: ``before_dlq_at`` and ``before_id`` set to its ``dlq_at`` and job id."""
    flt = filter or ListDlqFilter()
    q = ctx.schema.dlq
    stmt = select(q).where(*_matching(ctx, flt)).order_by(q.c.dlq_at.desc(), q.c.job_id.desc())
    if flt.limit is not None:
        stmt = stmt.limit(flt.limit)
    return [_entry(r) for r in conn.execute(stmt)]


def load_dlq_entry(ctx: StorageContext, conn: Connection, job_id: int) -> DlqEntry | None:
    """The job's DLQ row, or None when the job is not in the DLQ."""
    q = ctx.schema.dlq
    row = conn.execute(select(q).where(q.c.job_id == job_id)).first()
    return None if row is None else _entry(row)


def purge_dlq(ctx: StorageContext, conn: Connection, kind: str | None = None,
              queue: str | None = None) -> int:
    """Delete the DLQ rows of ``kind`` and/or logical ``queue`` (every DLQ row when both are
    None) and release their unique keys; returns how many went. Terminal counts do not
    change (DLQ rows are not terminal history); ``load_job`` of a purged job returns None."""
    sch = ctx.schema
    rows = queue_plane.discard_dlq_where(conn, sch, *_matching(ctx, ListDlqFilter(kind=kind, queue=queue)))
    control.release_keys(conn, sch, [(r.unique_key, r.job_id) for r in rows if r.unique_key is not None])
    return len(rows)


def discard_failed_by_kind(ctx: StorageContext, conn: Connection, kind: str) -> int:
    """Delete failed terminal rows (-1 deltas) and DLQ rows of ``kind``; release their keys.
    Returns how many rows went."""
    sch = ctx.schema
    d = sch.done.parent
    rows = conn.execute(queue_plane.select_done(sch, d.c.state == JobState.FAILED, d.c.kind == kind)).all()
    queue_plane.delete_done(conn, sch, rows)
    dl = queue_plane.discard_dlq_kind(conn, sch, kind)
    control.release_keys(conn, sch, [(r.unique_key, r.job_id) for r in rows if r.unique_key is not None]
                         + [(r.unique_key, r.job_id) for r in dl if r.unique_key is not None])
    return len(rows) + len(dl)
