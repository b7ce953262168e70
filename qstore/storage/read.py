"""Reads: ``load_job`` (the newest view of a job across every plane) and queue counts
(exact and fast).

``load_job`` reads in several statements and runs under the ``SNAPSHOT`` policy as
:data:`load_job_snapshot`, which holds the ring tables it reads before its snapshot is
taken (see :func:`qstore.storage.targets.holding`). The counts are one statement each: a
statement locks every table it reads before its own snapshot in READ COMMITTED, so a
``TRUNCATE`` can never land between the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    CompoundSelect,
    Connection,
    Select,
    Table,
    and_,
    bindparam,
    case,
    func,
    select,
    true,
    union_all,
)
from sqlalchemy.types import BigInteger, Text

from qstore.schema import StorageSchema
from qstore.schema.queue_plane import batch_member_total
from qstore.storage.columns import ORIGINAL_PRIORITY_KEY, body_job, payload_fields
from qstore.storage.context import StorageContext
from qstore.storage.jobs import stripes_for
from qstore.storage.planes import queue as queue_plane
from qstore.storage.statements import (
    AttemptProgress,
    attempt_leased,
    attempt_progress,
    live_deferred,
    receipt_open,
)
from qstore.storage.targets import holding
from qstore.types import JobRow, JobState, QueueCounts

__all__ = ["load_job", "load_job_snapshot", "queue_counts", "queue_counts_fast", "snapshot_row",
           "truncated_by_upkeep"]


def truncated_by_upkeep(sch: StorageSchema) -> tuple[Table, ...]:
    """Every table upkeep truncates: the partitioned parents of the three rings (a lock on a
    parent covers its children), in ring order, then the terminal live counts (which the
    counter rebuild truncates), then the deferred wheel and its marks."""
    return (*(family.parent for ring in sch.rings for family in ring.families), sch.live_counts,
            sch.wheel.parent, sch.wheel_marks.parent)


@dataclass(frozen=True)
class ReadStatements:
    ready: Select[Any]
    tombstoned: Select[Any]
    deferred: Select[Any]
    dlq: Select[Any]
    leases: Select[Any]
    open_claims: Select[Any]
    terminal: CompoundSelect
    counts: Select[Any]
    fast_counts: Select[Any]
    scheduled: Select[Any]


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> ReadStatements:
    r, t = sch.ready.parent, sch.tombstones.parent
    c, le, st = sch.claims.parent, sch.leases.parent, sch.attempt_state
    job = bindparam("job_id", type_=BigInteger())
    queues = bindparam("queues", type_=Text(), expanding=True)
    waiting = live_deferred(sch)
    claimed = queue_plane.ready_claimed(sch, r)
    is_open = receipt_open(sch, c)
    leased = attempt_leased(le, c)
    h = sch.claim_heads
    receipts = sch.config.lease_claim_receipts
    lp = attempt_progress(sch, "lp", le.c.job_id, le.c.run_lease, None if receipts else le.c.lease_slot)
    cp = attempt_progress(sch, "cp", c.c.job_id, c.c.run_lease, c.c.claim_slot)
    lease_progress, claim_progress = AttemptProgress(lp, st), AttemptProgress(cp, st)

    def total(col: Any) -> Any:
        return func.coalesce(select(func.sum(col)).where(col.table.c.queue.in_(queues)).scalar_subquery(), 0)

    def count(rows: Any) -> Any:
        return rows.with_only_columns(func.count()).scalar_subquery()

    # pruned history: permanent rollups plus the ledger prunes append to until it is folded
    pruned = total(sch.rollups.c.pruned_completed_count) + total(sch.rollup_ledger.c.pruned_count)
    live = total(sch.live_counts.c.live_terminal_count)
    deltas = total(sch.deltas.parent.c.terminal_delta)
    db = sch.done_batches.parent
    scanned = (count(select(sch.done.parent.c.job_id).where(sch.done.parent.c.queue.in_(queues)))
               + func.coalesce(select(batch_member_total(db)).where(db.c.queue.in_(queues)).scalar_subquery(), 0))
    trusted = select(sch.counter_state.c.terminal_counter_trusted_at.isnot(None)).scalar_subquery()
    last = lambda seq: func.coalesce(func.pg_sequence_last_value(seq), 0)  # noqa: E731
    return ReadStatements(
        ready=select(r, claimed.label("claimed")).where(r.c.job_id == job),
        tombstoned=select(t.c.lane_seq, t.c.ready_slot, t.c.queue, t.c.priority, t.c.enqueue_shard)
        .where(t.c.job_id == job),
        deferred=select(waiting).where(waiting.c.job_id == job),
        dlq=select(sch.dlq).where(sch.dlq.c.job_id == job),
        leases=select(le, lease_progress.progress.label("progress"),
                      lease_progress.heartbeat_at.label("state_heartbeat_at"))
        .select_from(le.outerjoin(st, and_(st.c.job_id == le.c.job_id, st.c.run_lease == le.c.run_lease))
                     .outerjoin(lp, true()))
        .where(le.c.job_id == job),
        open_claims=select(c, claim_progress.progress.label("progress"),
                           claim_progress.heartbeat_at.label("state_heartbeat_at"))
        .select_from(c.outerjoin(st, and_(st.c.job_id == c.c.job_id, st.c.run_lease == c.c.run_lease))
                     .outerjoin(cp, true()))
        .where(c.c.job_id == job, is_open, ~leased),
        # done rows of the job, hydrated from their ready rows as the terminal_jobs view does
        # and the job's members of batch done rows, in the same statement
        terminal=union_all(queue_plane.select_done_of_job(sch, job, lock=False),
                           queue_plane.select_batch_done_of_job(sch, job)),
        # one statement, so the three counts come from one snapshot
        counts=select(
            select(func.count()).select_from(queue_plane.unclaimed_ready(sch, queues)).scalar_subquery(),
            count(select(le.c.job_id).where(le.c.queue.in_(queues), le.c.state == JobState.RUNNING))
            + count(select(c.c.job_id).where(c.c.queue.in_(queues), is_open, ~leased)),
            case((func.coalesce(trusted, False), pruned + live + deltas), else_=pruned + scanned),
        ),
        scheduled=select(func.count()).select_from(waiting).where(waiting.c.queue.in_(queues)),
        fast_counts=select(
            select(func.coalesce(func.sum(func.greatest(last(h.c.enqueue_seq) - last(h.c.claim_seq), 0)), 0))
            .where(h.c.queue.in_(queues)).scalar_subquery(),
            count(select(le.c.job_id).where(le.c.queue.in_(queues), le.c.state == JobState.RUNNING)),
            pruned,
        ),
    )


def snapshot_row(d: Any) -> JobRow:
    """JobRow of a wide snapshot row (deferred, terminal view or DLQ) in its stored state."""
    return body_job(d, JobState(d.state), finalized_at=d.finalized_at)


def load_job(ctx: StorageContext, conn: Connection, job_id: int) -> JobRow | None:
    """Newest view of ``job_id`` across ready, deferred, running, terminal and DLQ rows:
    greatest ``(run_lease, transition time, state rank)``. A ready row counts as available
    only while unclaimed (not tombstoned, not covered by a claim range), as in the exact
    counts. None once its history is pruned, discarded or purged from the DLQ."""
    s = _statements(ctx.schema)
    arg = {"job_id": job_id}
    cands: list[tuple[tuple[int, datetime, int], JobRow]] = []
    tomb = {(x.ready_slot, x.queue, x.priority, x.enqueue_shard, x.lane_seq) for x in conn.execute(s.tombstoned, arg)}
    ready_by_key = {}
    for r in conn.execute(s.ready, arg):
        ready_by_key[(r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq)] = r
        if r.claimed or (r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq) in tomb:
            continue  # claimed: its attempt is elsewhere (or purged); tombstoned: moved or void
        cands.append(((r.run_lease, r.run_at, 2), body_job(r, JobState.AVAILABLE)))
    for d in conn.execute(s.deferred, arg):
        cands.append(((d.run_lease, d.finalized_at or d.run_at, 3), snapshot_row(d)))
    for kind in ("leases", "open_claims"):
        for x in conn.execute(getattr(s, kind), arg):
            body = ready_by_key.get((x.ready_slot, x.queue, x.priority, x.enqueue_shard, x.lane_seq))
            if body is None:
                continue
            is_lease = kind == "leases"
            state = JobState(x.state) if is_lease else JobState.RUNNING
            attempted = x.attempted_at if is_lease else x.claimed_at
            hb = x.state_heartbeat_at or (x.heartbeat_at if is_lease else None)
            fields = payload_fields(body.payload)
            if x.effective_priority != x.priority:
                fields["metadata"].setdefault(ORIGINAL_PRIORITY_KEY, x.priority)
            if x.progress is not None:
                fields["progress"] = x.progress
            row = JobRow(id=x.job_id, kind=body.kind, queue=x.queue, args=body.args, state=state,
                         priority=x.effective_priority, attempt=x.attempt, run_lease=x.run_lease,
                         max_attempts=x.max_attempts, run_at=body.run_at, created_at=body.created_at,
                         heartbeat_at=hb, deadline_at=x.deadline_at, attempted_at=attempted,
                         unique_key=body.unique_key, unique_states=body.unique_states,
                         callback_id=getattr(x, "callback_id", None) if is_lease else None,
                         callback_timeout_at=getattr(x, "callback_timeout_at", None) if is_lease else None,
                         **fields)
            cands.append(((x.run_lease, hb or attempted or body.run_at, 4), row))
    for d in conn.execute(s.terminal, arg):
        cands.append(((d.run_lease, d.finalized_at, 1), snapshot_row(d)))
    for d in conn.execute(s.dlq, arg):
        cands.append(((d.run_lease, d.dlq_at, 1), snapshot_row(d)))
    if not cands:
        return None
    return max(cands, key=lambda c: c[0])[1]


def queue_counts(ctx: StorageContext, conn: Connection, queue: str) -> QueueCounts:
    """Exact counts over all stripes of ``queue``, read in one statement (one snapshot):
    available = untombstoned ready rows not covered by a claim range; running = running
    leases + receipt-only open claims; terminal = pruned history (rollups and the prune
    ledger) + live counters and deltas (trusted) or a done-row scan. Available reads the
    queue's ready rows in the ring and their claim ranges once, in one sort
    (:func:`~qstore.storage.planes.queue.unclaimed_ready`): its cost is a sort of those rows
    plus those ranges, not a comparison of every row with every range of its lane."""
    queues = stripes_for(queue, ctx.config.queue_stripe_count)
    available, running, terminal = conn.execute(_statements(ctx.schema).counts, {"queues": queues}).one()
    return QueueCounts(available=int(available), running=int(running), terminal=int(terminal))


def scheduled_count(ctx: StorageContext, conn: Connection, queue: str) -> int:
    """Jobs of ``queue`` waiting for their time in the deferred backlog (scheduled and
    retryable: live wheel entries and overflow rows), exact in one statement; it scans the
    backlog, so it costs in proportion to it (meant for a metrics collection, not a hot
    path)."""
    queues = stripes_for(queue, ctx.config.queue_stripe_count)
    return int(conn.execute(_statements(ctx.schema).scheduled, {"queues": queues}).scalar_one())


def queue_counts_fast(ctx: StorageContext, conn: Connection, queue: str) -> QueueCounts:
    """Head-table arithmetic only. ``available`` is an upper bound (Σ enqueue - claim cursor:
    counts in-flight reservations, aborted gaps, tombstones and up to one claim batch per
    lane whose cursor hint has not caught up); ``running`` omits receipt-only attempts;
    ``terminal`` counts pruned history only (a lower bound)."""
    queues = stripes_for(queue, ctx.config.queue_stripe_count)
    available, running, terminal = conn.execute(_statements(ctx.schema).fast_counts, {"queues": queues}).one()
    return QueueCounts(available=int(available), running=int(running), terminal=int(terminal))


def _job_tables(ctx: StorageContext) -> tuple[Table, ...]:
    sch = ctx.schema
    # what load_job reads of the rings (its done rows are found through and hydrated from ready rows), in
    # the rings' order, as prune locks them
    rings = {sch.ready.parent, sch.tombstones.parent, sch.claim_ranges.parent, sch.done.parent,
             sch.done_batches.parent, sch.leases.parent, sch.claims.parent, sch.closures.parent,
             sch.closure_batches.parent, sch.progress.parent}
    return (*(f.parent for ring in sch.rings for f in ring.families if f.parent in rings),
            sch.wheel.parent, sch.wheel_marks.parent)


#: :func:`load_job` as the ``SNAPSHOT`` operation runs it: the ring tables it reads are held
#: first, so its statements all see one state of the rings. Other operations that look a job
#: up inside their own transaction call :func:`load_job`.
load_job_snapshot = holding(_job_tables)(load_job)
