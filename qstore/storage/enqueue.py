"""Enqueue: ``enqueue_params_batch`` (one multi-row INSERT), ``enqueue_params_copy`` (COPY)
and ``enqueue_batch`` (synthetic benchmark jobs).

Everything is validated first; then ids are allocated, unique keys taken, lane positions
reserved (the reservation lock is held until the enqueue commits), ready rows written into
the current queue slot and deferred rows into the backlog, and every logical queue that
received ready rows is notified (PostgreSQL delivers it on commit). A unique conflict
raises and, the operation being atomic, leaves nothing of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from qstore.storage.context import StorageContext
from qstore.storage.jobs import InsertOpts, InsertParams, PreparedJob, holds_key, prepare_jobs
from qstore.storage.lanes import assign_lanes
from qstore.storage.planes import control, queue

__all__ = ["enqueue", "enqueue_batch", "enqueue_many", "enqueue_params_batch", "enqueue_params_copy", "write_jobs"]


def write_jobs(conn: Connection, ctx: StorageContext, rows: Sequence[PreparedJob], *, use_copy: bool) -> int:
    """Write new, validated jobs on ``conn``'s transaction. Returns rows written."""
    if not rows:
        return 0
    sch = ctx.schema
    queue.allocate_ids(conn, sch, rows)
    control.acquire_keys(conn, sch, [(r.unique_key, r.job_id) for r in rows
                                     if r.unique_key is not None and holds_key(r.unique_states, r.state)])
    ready = [r for r in rows if r.run_at is None]
    deferred = [r for r in rows if r.run_at is not None]
    assign_lanes(conn, ctx, ready)
    if ready:
        (queue.copy_ready if use_copy else queue.insert_ready)(conn, sch, ready)
    if deferred:
        queue.insert_deferred(conn, sch, deferred)
    queue.notify_queues(conn, sch, {r.logical for r in ready})
    return len(rows)


def enqueue(ctx: StorageContext, conn: Connection, job: InsertParams) -> int:
    """Write one job and return its id (a unique conflict raises and writes nothing)."""
    rows = prepare_jobs([job], ctx.config.queue_stripe_count, field="job")
    write_jobs(conn, ctx, rows, use_copy=False)
    assert rows[0].job_id is not None
    return rows[0].job_id


def enqueue_many(ctx: StorageContext, conn: Connection, jobs: Sequence[InsertParams]) -> list[int]:
    """Write ``jobs`` like ``enqueue_params_batch`` and return their ids, in batch order."""
    rows = prepare_jobs(jobs, ctx.config.queue_stripe_count)
    write_jobs(conn, ctx, rows, use_copy=False)
    return [r.job_id for r in rows if r.job_id is not None]


def enqueue_params_batch(ctx: StorageContext, conn: Connection, jobs: Sequence[InsertParams]) -> int:
    """Write ``jobs`` (multi-row INSERT). All rows are validated before anything is written;
    a unique conflict writes nothing. Returns rows written."""
    return write_jobs(conn, ctx, prepare_jobs(jobs, ctx.config.queue_stripe_count), use_copy=False)


def enqueue_params_copy(ctx: StorageContext, conn: Connection, jobs: Sequence[InsertParams]) -> int:
    """Same semantics as ``enqueue_params_batch``, streaming the ready rows with COPY."""
    return write_jobs(conn, ctx, prepare_jobs(jobs, ctx.config.queue_stripe_count), use_copy=True)


def enqueue_batch(ctx: StorageContext, conn: Connection, queue: str, priority: int, count: int) -> int:
    """Benchmark helper: ``count`` available ``bench_job`` jobs with args ``{"seq": i}``,
    round-robin over the stripes (COPY). Returns rows written."""
    opts = InsertOpts(queue=queue, priority=priority)
    jobs: list[Any] = [InsertParams("bench_job", {"seq": i}, opts) for i in range(count)]
    return write_jobs(conn, ctx, prepare_jobs(jobs, ctx.config.queue_stripe_count), use_copy=True)
