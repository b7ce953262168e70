"""Queue plane: the only Python writer of the queue ring (ready entries, tombstones, done
entries, terminal count deltas), the deferred backlog (the wheel, its marks and the
overflow) and the DLQ.

Ready entries are immutable (a job that moves gets a new row and a tombstone on the old
one), and every row carries the ring ``(slot, generation)`` it was written at: writers read
the ring cursor in the inserting statement (COPY, which cannot, reads it just before).
Every done-row insert or delete appends a signed terminal-count delta in the same
transaction; nothing here updates a counter row. NOTIFY wake-ups are transactional: they
are delivered when the writing transaction commits.

The deferred wheel is append-only: a waiting job is an entry in the bucket of its
``run_at`` (``wheel_bucket``), and whatever ends its wait (promotion, cancel, an operator's
move) appends a mark for the entry, unique per entry, with ``ON CONFLICT DO NOTHING
RETURNING``: the one writer whose mark lands owns the job, so no entry is promoted or
cancelled twice. Waits due beyond the wheel's span are rows of ``deferred_jobs`` (the
overflow), deleted when they move into the wheel or end.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import (
    BigInteger,
    Connection,
    Exists,
    Insert,
    Integer,
    Select,
    SmallInteger,
    Subquery,
    Text,
    and_,
    bindparam,
    cast,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    text,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, REGCLASS, TIMESTAMP
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningDelete
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.util import ClauseAdapter
from sqlalchemy.util.concurrency import await_

from qstore.config import (
    COUNTER_BUCKETS,
    DONE_BLOCK,
    WHEEL_BUCKET_SECONDS,
    WHEEL_GUARD_SLOTS,
    WHEEL_SLOTS,
)
from qstore.schema import StorageSchema
from qstore.schema.queue_plane import WheelResolution, at_lane_position, done_members, wide_done_row
from qstore.schema.types import OPTIONAL_JSON
from qstore.storage.bodies import Body
from qstore.storage.columns import body_values
from qstore.storage.jobs import PreparedJob
from qstore.storage.statements import HotStatement, schema_func, unnest_rows, wheel_entry_live
from qstore.types import JobState

__all__ = [
    "NO_DUE_BOUND",
    "DueKey",
    "QueueStatements",
    "advance_overflow",
    "allocate_ids",
    "copy_ready",
    "delete_done",
    "due_bound",
    "insert_deferred",
    "insert_ready",
    "lock_wheel_slot",
    "notify",
    "notify_queues",
    "ready_claimed",
    "ready_tombstoned",
    "select_batch_done_of_job",
    "select_done",
    "select_done_of_job",
    "statements",
    "take_deferred",
    "take_due",
    "tombstone",
    "truncate_wheel_slot",
    "unclaimed_ready",
    "wheel_bucket_now",
    "wheel_slot_unresolved",
    "wheel_slot_written",
    "write_deferred",
    "write_deltas",
    "write_dlq",
    "write_terminal",
]

READY_COLUMNS: dict[str, Any] = {
    "job_id": BigInteger(), "kind": Text(), "queue": Text(), "args": JSONB(),
    "priority": SmallInteger(), "attempt": SmallInteger(), "run_lease": BigInteger(),
    "max_attempts": SmallInteger(), "lane_seq": BigInteger(), "enqueue_shard": SmallInteger(),
    "created_at": TIMESTAMP(timezone=True), "unique_key": BYTEA(), "unique_states": Text(),
    "payload": OPTIONAL_JSON,
}
_HYDRATED = ("args", "max_attempts", "run_at", "created_at", "unique_key", "unique_states", "payload")
_COPY_FIELDS = ("ready_slot", "ready_generation", "job_id", "kind", "queue", "args", "priority",
                "attempt", "run_lease", "max_attempts", "lane_seq", "enqueue_shard",
                "unique_key", "unique_states", "payload")
_JSON_NULL: ColumnElement[Any] = literal_column("'null'::jsonb")


@dataclass(frozen=True)
class QueueStatements:
    """The queue plane's statements for one install, built once."""

    ids: Select[Any]
    ring: Select[Any]
    ready: Insert
    notify: Select[Any]
    tombstone: Insert
    done_base: Select[Any]
    done_columns: tuple[Any, ...]
    done_hydration: Any
    take_dlq: ReturningDelete[Any]


@functools.lru_cache(maxsize=64)
def statements(sch: StorageSchema) -> QueueStatements:
    rs = sch.queue_ring.state
    u = unnest_rows("u", **READY_COLUMNS)
    now = func.clock_timestamp()
    ready_sel = select(
        rs.c.current_slot, rs.c.generation,
        *(u.c[c] for c in READY_COLUMNS if c != "created_at"),
        func.coalesce(u.c.created_at, now), now,
    ).select_from(rs.join(u, true()))
    ready_cols = ["ready_slot", "ready_generation",
                  *(c for c in READY_COLUMNS if c != "created_at"), "created_at", "run_at"]
    n = unnest_rows("n", channel=Text())
    t = sch.tombstones.parent
    d, r = sch.done.parent, sch.ready.parent
    join = and_(at_lane_position(r, d), r.c.ready_generation == d.c.ready_generation)
    cols = [d.c.ready_slot, d.c.ready_generation, d.c.job_id, d.c.kind, d.c.queue, d.c.state,
            d.c.priority, d.c.attempt, d.c.run_lease, d.c.lane_seq, d.c.enqueue_shard,
            d.c.attempted_at, d.c.finalized_at]
    # a JSON null payload (what an older release's general terminal path wrote) is absent
    hyd = [func.coalesce(*((func.nullif(d.c[c], _JSON_NULL), func.nullif(r.c[c], _JSON_NULL))
                           if c == "payload" else (d.c[c], r.c[c]))).label(c)
           for c in _HYDRATED]
    q = sch.dlq
    job = bindparam("b_job", type_=BigInteger())
    return QueueStatements(
        # A bound regclass, not Sequence.next_value(): SQLAlchemy's cache key of
        # next_value() omits the sequence's schema, so two installs on one Engine would
        # share one plan.
        ids=select(func.nextval(literal(f"{sch.config.schema}.{sch.job_id_seq.name}", REGCLASS())))
        .select_from(func.generate_series(1, bindparam("n", type_=Integer()))),
        ring=select(rs.c.current_slot, rs.c.generation),
        ready=insert(sch.ready.parent).from_select(ready_cols, ready_sel),
        notify=select(func.count(func.pg_notify(n.c.channel, ""))).select_from(n),
        tombstone=insert(t).values(
            ready_slot=bindparam("k_slot"), ready_generation=bindparam("k_gen"),
            queue=bindparam("k_queue"), priority=bindparam("k_priority"),
            enqueue_shard=bindparam("k_shard"), lane_seq=bindparam("k_seq"), job_id=job),
        done_base=select(*cols, *hyd).select_from(d.outerjoin(r, join)),
        done_columns=(*cols, *hyd),
        done_hydration=join,
        take_dlq=q.delete().where(q.c.job_id == job).returning(*q.c),
    )


# -- new jobs -----------------------------------------------------------------------------------
def allocate_ids(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob]) -> None:
    """Give each row a job id from the install's ``job_id_seq``."""
    ids = conn.execute(statements(sch).ids, {"n": len(rows)}).scalars().all()
    for row, job_id in zip(rows, ids, strict=True):
        row.job_id = job_id


def insert_ready(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob],
                 attempts: Sequence[int] | None = None, run_leases: Sequence[int] | None = None,
                 created: Sequence[Any] | None = None) -> None:
    """One multi-row INSERT of ready rows (lane positions already reserved) into the ring's
    current slot, read in the same statement; ``run_at`` is now."""
    n = len(rows)
    conn.execute(statements(sch).ready, {
        "job_id": [r.job_id for r in rows], "kind": [r.kind for r in rows],
        "queue": [r.queue for r in rows], "args": [r.args for r in rows],
        "priority": [r.priority for r in rows],
        "attempt": list(attempts) if attempts is not None else [0] * n,
        "run_lease": list(run_leases) if run_leases is not None else [0] * n,
        "max_attempts": [r.max_attempts for r in rows], "lane_seq": [r.lane_seq for r in rows],
        "enqueue_shard": [r.shard for r in rows],
        "created_at": list(created) if created is not None else [None] * n,
        "unique_key": [r.unique_key for r in rows], "unique_states": [r.unique_states for r in rows],
        "payload": [r.payload for r in rows],
    })


def copy_ready(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob]) -> None:
    """Stream ready rows with ``COPY … FROM STDIN`` on ``conn``'s transaction.

    COPY cannot read the ring cursor itself, so it is read in the same transaction just
    before. A row that lands in a slot the ring has since sealed is legal: every row carries
    its own (slot, generation), and prune gates examine every physical row of a child
    regardless of generation.
    """
    slot, generation = conn.execute(statements(sch).ring).one()
    raw = conn.connection.driver_connection
    assert raw is not None, "COPY needs a live DBAPI connection"
    prep = conn.dialect.identifier_preparer
    target = f"{prep.quote_schema(sch.config.schema)}.{prep.quote(sch.ready.parent.name)}"
    sql = f"COPY {target} ({', '.join(_COPY_FIELDS)}) FROM STDIN"
    values = [(
        slot, generation, r.job_id, r.kind, r.queue, Jsonb(r.args), r.priority, 0, 0,
        r.max_attempts, r.lane_seq, r.shard, r.unique_key, r.unique_states,
        Jsonb(r.payload) if r.payload is not None else None,
    ) for r in rows]
    if isinstance(raw, psycopg.AsyncConnection):  # the async face, reached in a greenlet
        await_(_copy_async(raw, sql, values))
        return
    with raw.cursor() as cur, cur.copy(sql) as cp:
        for v in values:
            cp.write_row(v)


async def _copy_async(raw: Any, sql: str, values: Sequence[tuple[Any, ...]]) -> None:
    async with raw.cursor() as cur, cur.copy(sql) as cp:
        for v in values:
            await cp.write_row(v)


def insert_deferred(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob]) -> None:
    """New scheduled jobs (``run_at`` in the future) into the deferred backlog: the wheel, or
    the overflow when due beyond its span."""
    n = len(rows)
    conn.execute(deferred_statements(sch).defer, {
        "job_id": [r.job_id for r in rows], "kind": [r.kind for r in rows],
        "queue": [r.queue for r in rows], "args": [r.args for r in rows],
        "state": [JobState.SCHEDULED.value] * n, "priority": [r.priority for r in rows],
        "attempt": [0] * n, "run_lease": [0] * n,
        "max_attempts": [r.max_attempts for r in rows],
        "run_at": [r.run_at for r in rows], "attempted_at": [None] * n, "finalized_at": [None] * n,
        "created_at": [None] * n,
        "unique_key": [r.unique_key for r in rows],
        "unique_states": [r.unique_states for r in rows],
        "payload": [r.payload for r in rows],
    })


def notify_queues(conn: Connection, sch: StorageSchema, logicals: set[str]) -> None:
    """Transactional wake-up of ``logicals``' claimers: delivered only if the transaction
    commits."""
    if logicals:
        channels = sorted(sch.config.notify_channel(q) for q in logicals)
        conn.execute(statements(sch).notify, {"channel": channels})


def notify(conn: Connection, channel: str, payload: str) -> None:
    """``pg_notify(channel, payload)``, delivered if the transaction commits."""
    conn.execute(select(func.pg_notify(channel, payload)))


def tombstone(conn: Connection, sch: StorageSchema, row: Any) -> None:
    """Void the unclaimed ready row ``row`` (its lane's claim head must be locked)."""
    conn.execute(statements(sch).tombstone, {
        "k_slot": row.ready_slot, "k_gen": row.ready_generation, "k_queue": row.queue,
        "k_priority": row.priority, "k_shard": row.enqueue_shard, "k_seq": row.lane_seq,
        "b_job": row.job_id})


# -- where a job goes next ----------------------------------------------------------------------
def write_deferred(conn: Connection, sch: StorageSchema,
                   items: Sequence[tuple[Body, JobState, datetime, datetime | None]]) -> None:
    """``(body, scheduled|retryable, run_at, finalized_at)`` rows into the deferred backlog:
    each an entry of the wheel, or an overflow row when due beyond the wheel's span. One
    statement for all of them."""
    if not items:
        return
    values = [{**body_values(b.job), "state": st.value, "run_at": run_at, "finalized_at": fin}
              for b, st, run_at, fin in items]
    conn.execute(deferred_statements(sch).defer, {c: [v.get(c) for v in values] for c in SNAPSHOT_COLUMNS})


def write_terminal(conn: Connection, sch: StorageSchema, items: Sequence[tuple[Body, JobState]],
                   finalized_at: datetime, *, ready_payloads: dict[int, Any] | None = None) -> None:
    """Done rows (+ count deltas). Bodies with ring keys get narrow rows (body columns NULL,
    payload only when it differs from the ready row's); others get wide synthetic rows in
    the current queue slot with ``lane_seq = -job_id`` (never collides with a real lane)."""
    if not items:
        return
    narrow_rows: list[dict[str, Any]] = []  # body columns absent (NULL)
    wide_rows: list[dict[str, Any]] = []  # the whole body
    wide = [(b, st) for b, st in items if b.ready is None]
    slot = gen = 0
    if wide:
        slot, gen = conn.execute(statements(sch).ring).one()
    for b, st in items:
        j, ready = b.job, b.ready
        if ready is not None:
            base = (ready_payloads or {}).get(j.id, "__unknown__")
            payload = b.payload
            narrow_rows.append({
                "ready_slot": ready.ready_slot, "ready_generation": ready.ready_generation,
                "job_id": j.id, "kind": j.kind, "queue": j.queue, "state": st.value,
                "priority": j.priority, "attempt": j.attempt, "run_lease": j.run_lease,
                "lane_seq": ready.lane_seq, "enqueue_shard": ready.enqueue_shard,
                "attempted_at": j.attempted_at, "finalized_at": finalized_at,
                "payload": None if payload == base else payload,
            })
        else:
            wide_rows.append({
                **body_values(j), "ready_slot": slot, "ready_generation": gen, "state": st.value,
                "lane_seq": -j.id, "enqueue_shard": 0, "finalized_at": finalized_at,
            })
    # the two kinds carry different columns: one executemany each (an executemany takes its
    # column list from its first row)
    for group in (narrow_rows, wide_rows):
        if group:
            conn.execute(insert(sch.done.parent), group)
    write_deltas(conn, sch, [(r["ready_slot"], r["ready_generation"], r["queue"], r["priority"],
                              r["enqueue_shard"], r["job_id"]) for r in (*narrow_rows, *wide_rows)], +1)


def write_dlq(conn: Connection, sch: StorageSchema, items: Sequence[tuple[Body, str, int]], at: datetime) -> None:
    """``(body, dlq_reason, original_run_lease)`` rows into the DLQ (state failed)."""
    if not items:
        return
    conn.execute(insert(sch.dlq), [{
        **body_values(b.job), "state": JobState.FAILED, "finalized_at": at, "dlq_reason": reason, "dlq_at": at,
        "original_run_lease": orig,
    } for b, reason, orig in items])


def write_deltas(conn: Connection, sch: StorageSchema, rows: Sequence[tuple[int, int, str, int, int, int]],
                 sign: int) -> None:
    """Append grouped terminal-count deltas for ``(ready_slot, gen, queue, priority, shard,
    job_id)`` rows, in key order (no counter row is ever updated on this path)."""
    if not rows:
        return
    grouped = Counter((s, g, q, p, sh, j % COUNTER_BUCKETS) for s, g, q, p, sh, j in rows)
    conn.execute(insert(sch.deltas.parent), [
        {"ready_slot": s, "ready_generation": g, "queue": q, "priority": p, "enqueue_shard": sh,
         "counter_bucket": b, "terminal_delta": sign * n}
        for (s, g, q, p, sh, b), n in sorted(grouped.items())
    ])


# -- ready rows no claim took -----------------------------------------------------------------
def ready_tombstoned(sch: StorageSchema, row: Any) -> Exists:
    """``EXISTS`` a tombstone for ready row ``row`` (the same slot, lane and position)."""
    t = sch.tombstones.parent
    return select(t.c.job_id).where(at_lane_position(t, row)).exists()


def ready_claimed(sch: StorageSchema, row: Any) -> Exists:
    """``EXISTS`` a claim range of ready row ``row``'s lane that covers its position: the
    lookup for one row (a job's, or one under its lane's head lock); many rows are read
    through :func:`unclaimed_ready` instead."""
    cr = sch.claim_ranges.parent
    return select(cr.c.first_seq).where(
        cr.c.queue == row.c.queue, cr.c.priority == row.c.priority, cr.c.enqueue_shard == row.c.enqueue_shard,
        cr.c.first_seq <= row.c.lane_seq, cr.c.last_seq >= row.c.lane_seq).exists()


def unclaimed_ready(sch: StorageSchema, queues: Any = None, *where: Any, name: str = "unclaimed") -> Subquery:
    """The ready rows that no claim has taken: untombstoned, at a position that no claim
    range of their lane covers (``first_seq <= lane_seq <= last_seq``). ``queues`` (an
    expanding bind parameter or a list; ``None``: every queue) limits both the rows and the
    ranges read; ``where`` are further conditions on the rows (``ready_entries``) alone.
    Columns: the row's key (``ready_slot``, ``queue``, ``priority``, ``enqueue_shard``,
    ``lane_seq``). With ``where``, only the ranges of lanes that have such rows are read.
    ``name`` names the subquery (and its parts); it must be unique within a statement.

    The answer is the one a lookup of the covering range per row would give, computed in one
    ordered pass: the rows and their lanes' ranges are read once, ordered by lane and
    position (a range before a row at the same position), and a row is covered exactly when
    the greatest ``last_seq`` of the ranges before it reaches its position. A lookup per row
    (``NOT EXISTS`` a covering range) is planned as a hash join on the lane, which compares
    every row with every range of its lane: on a backlog claimed one job at a time that is
    rows times ranges, seconds for 40,000 rows. This is one sort of the rows plus the ranges."""
    r, cr = sch.ready.parent, sch.claim_ranges.parent
    rows = select(r.c.queue, r.c.priority, r.c.enqueue_shard, r.c.lane_seq.label("pos"), r.c.ready_slot,
                  literal_column("1", Integer()).label("is_row"), cast(null(), BigInteger).label("last_seq"))
    ranges = select(cr.c.queue, cr.c.priority, cr.c.enqueue_shard, cr.c.first_seq, cr.c.ready_slot,
                    literal_column("0", Integer()), cr.c.last_seq)
    if queues is not None:
        rows, ranges = rows.where(r.c.queue.in_(queues)), ranges.where(cr.c.queue.in_(queues))
    rows = rows.where(~ready_tombstoned(sch, r), *where)
    if where:  # the rows are read once; only the ranges of their lanes are read
        found = rows.cte(f"{name}_rows")
        rows = select(found)
        ranges = ranges.where(tuple_(cr.c.queue, cr.c.priority, cr.c.enqueue_shard).in_(
            select(found.c.queue, found.c.priority, found.c.enqueue_shard)))
    p = union_all(rows, ranges).subquery(f"{name}_positions")
    reach = func.max(p.c.last_seq).over(partition_by=(p.c.queue, p.c.priority, p.c.enqueue_shard),
                                        order_by=(p.c.pos, p.c.is_row), rows=(None, 0))
    w = select(p, reach.label("reach")).subquery(f"{name}_reach")
    return (select(w.c.ready_slot, w.c.queue, w.c.priority, w.c.enqueue_shard, w.c.pos.label("lane_seq"))
            .where(w.c.is_row == 1, or_(w.c.reach.is_(None), w.c.reach < w.c.pos)).subquery(name))


# -- terminal history -------------------------------------------------------------------------
def select_done(sch: StorageSchema, *where: Any, newest_per_job: bool = False, limit: Any = None) -> Select[Any]:
    """Hydrated done rows matching ``where``, locked ``FOR UPDATE OF done SKIP LOCKED``."""
    d = sch.done.parent
    stmt = statements(sch).done_base.where(*where)
    if newest_per_job:
        stmt = stmt.order_by(d.c.finalized_at.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return stmt.with_for_update(of=d, skip_locked=True)


_DONE_KEY = ("ready_slot", "ready_generation", "queue", "priority", "enqueue_shard", "lane_seq")


def select_done_of_job(sch: StorageSchema, job_id: int | ColumnElement[Any], *where: Any,
                       newest_per_job: bool = False, limit: Any = None, lock: bool = True) -> Select[Any]:
    """The hydrated done rows of job ``job_id`` (an id or a bound parameter) matching
    ``where`` (conditions on ``done_entries``): :func:`select_done`'s rows and columns,
    locked ``FOR UPDATE OF done SKIP LOCKED`` unless ``lock`` is False. Every lookup of
    done rows by job id goes through here.

    ``done_entries`` has no ``job_id`` index for narrow rows (a claimed attempt's, body
    columns NULL): they are found through the job's ready rows (``ready_entries_job_id_idx``)
    joined on the lane key they share, one primary-key probe of ``done_entries`` per ready
    row. Wide rows (a body of their own, no ready row) are found through the partial index
    ``done_entries_wide_job_id_idx``. The two branches meet in a ``UNION ALL`` of lane keys,
    each tagged with the branch that found it, and a done row is taken only from the branch
    its own kind belongs to, so no row is returned twice.

    Unlocked, each key's done row is read by a ``LATERAL`` subquery with ``LIMIT 1`` (a lane
    key names at most one done row). The limit keeps the planner from flattening it into
    the outer query, and its reference to the key makes it a parameterised probe of the
    primary key per key, run in a nested loop whatever the tables' statistics (it cannot
    be hashed). Written as a plain join, a ring whose statistics were never gathered
    (autovacuum off, or a child just refilled) was planned as a hash join over every done
    row retained. The locked form keeps the join, so that its ``ORDER BY … LIMIT`` locks
    only the row it returns."""
    d, r = sch.done.parent, sch.ready.parent
    kr, kd = r.alias("kr"), d.alias("kd")
    wide = wide_done_row(kd)  # the predicate of done_entries_wide_job_id_idx
    keys = union_all(
        select(*(kr.c[c] for c in _DONE_KEY), kr.c.job_id, literal(False).label("wide")).where(kr.c.job_id == job_id),
        select(*(kd.c[c] for c in _DONE_KEY), kd.c.job_id, literal(True).label("wide")).where(kd.c.job_id == job_id, wide),
    ).subquery("k")
    s = statements(sch)
    # the job id is matched to the key's (a join condition), not to the bound value: a
    # restriction of done_entries on job_id would let the planner scan it for the few rows
    # it expects instead of probing its primary key
    on = and_(*(d.c[c] == keys.c[c] for c in _DONE_KEY), d.c.job_id == keys.c.job_id,
              wide_done_row(d) == keys.c.wide)
    if lock:
        stmt = (select(*s.done_columns)
                .select_from(keys.join(d, on).outerjoin(r, s.done_hydration))
                .where(*where))
        finalized: ColumnElement[Any] = d.c.finalized_at
    else:
        probe = select(d).where(on, *where).limit(1).lateral("dd")
        to_probe = ClauseAdapter(probe)
        stmt = (select(*(to_probe.traverse(c) for c in s.done_columns))
                .select_from(keys.join(probe, true()).outerjoin(r, to_probe.traverse(s.done_hydration))))
        finalized = probe.c.finalized_at
    if newest_per_job:
        stmt = stmt.order_by(finalized.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return stmt.with_for_update(of=d, skip_locked=True) if lock else stmt


def select_batch_done_of_job(sch: StorageSchema, job_id: int | ColumnElement[Any]) -> Select[Any]:
    """Job ``job_id``'s members of batch done rows (``done_batches``: completed attempts
    of the completion fast path), with :func:`select_done_of_job`'s columns and names, its
    body read from its ready rows. Found through the ready rows' ``job_id`` index and, per
    ready row, ``done_batches_lane_idx`` on the row's lane and block of positions, in a
    ``LATERAL`` subquery with ``LIMIT 1`` (a position is completed at most once, so it is a
    member of one batch row at most), which the planner cannot flatten: the batch rows are
    probed per ready row whatever the statistics (as a plain join, an unanalysed ring was
    read whole by a hash join). The limit also keeps the estimate of an unanalysed ring
    small. With ``OFFSET 0`` as the fence instead, ``EXPLAIN`` priced the statement above
    ``jit_above_cost`` at 400,000 ready rows, and compiling it took longer than running
    it. Not locked: a batch row is never updated or deleted."""
    r = sch.ready.parent
    m = done_members(sch.done_batches.parent, "m")
    on = and_(at_lane_position(m, r), m.c.ready_generation == r.c.ready_generation,
              m.c.lane_block == r.c.lane_seq // DONE_BLOCK, m.c.job_id == r.c.job_id)
    probe = select(m).where(on).limit(1).lateral("mm")
    mm = probe.c
    completed = cast(literal(JobState.COMPLETED.value), sch.done.parent.c.state.type)  # done rows' type
    return select(
        mm.ready_slot, mm.ready_generation, mm.job_id, r.c.kind, mm.queue,
        completed.label("state"), mm.priority, mm.attempt, mm.run_lease,
        mm.lane_seq, mm.enqueue_shard, mm.attempted_at, mm.finalized_at,
        *(func.nullif(r.c[c], _JSON_NULL).label(c) if c == "payload" else r.c[c] for c in _HYDRATED),
    ).select_from(r.join(probe, true())).where(r.c.job_id == job_id)


def delete_done(conn: Connection, sch: StorageSchema, rows: Sequence[Any]) -> None:
    """Delete the given done rows by primary key and append matching -1 deltas."""
    if not rows:
        return
    d = sch.done.parent
    keys = [(r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq) for r in rows]
    conn.execute(d.delete().where(
        tuple_(d.c.ready_slot, d.c.queue, d.c.priority, d.c.enqueue_shard, d.c.lane_seq).in_(keys)))
    write_deltas(conn, sch, [(r.ready_slot, r.ready_generation, r.queue, r.priority, r.enqueue_shard, r.job_id)
                             for r in rows], -1)


# -- the backlogs -------------------------------------------------------------------------------
def take_deferred(conn: Connection, sch: StorageSchema, job_id: int, states: Sequence[JobState],
                  resolution: WheelResolution = WheelResolution.CANCELLED) -> list[Any]:
    """End the job's wait if it is in one of ``states``: mark its live wheel entry
    ``resolution`` (a mark another writer already placed wins: then nothing is taken), or
    delete its overflow row. Returns the row taken (its job snapshot columns), or nothing.

    An overflow row that moved into the wheel while this waited for it is looked for in the
    wheel again (a new statement sees the move)."""
    d = deferred_statements(sch)
    arg = {"b_job": job_id, "states": [st.value for st in states], "resolution": resolution.value}
    rows = list(conn.execute(d.take_entry, arg).all())
    if not rows:
        rows = list(conn.execute(d.take_overflow, arg).all())
    if not rows:
        rows = list(conn.execute(d.take_entry, arg).all())
    return rows


#: The promotion order's key of a wait: ``(run_at, priority, job_id)``.
DueKey = tuple[datetime, int, int]
#: A key no wait goes beyond (the latest timestamp, priority and job id the columns hold).
NO_DUE_BOUND: DueKey = (datetime(9999, 12, 31, tzinfo=timezone.utc), 32767, 2**63 - 1)


def take_due(conn: Connection, sch: StorageSchema, state: JobState, limit: int,
             upto: DueKey = NO_DUE_BOUND) -> list[Any]:
    """Take up to ``limit`` due waits in ``state`` of unpaused queues whose key (``run_at``,
    priority, job id) is at most ``upto``, for promotion (the lowest keys first): wheel
    entries are marked ``promoted`` (entries locked by another taker are skipped), then, for
    what the limit leaves, due overflow rows are deleted (rows locked by others are
    skipped). ``RETURNING`` keeps no order."""
    d = deferred_statements(sch)
    run_at, priority, job_id = upto
    arg = {"state": state.value, "limit": limit, "upto_run_at": run_at, "upto_priority": priority,
           "upto_job": job_id}
    rows = list(conn.execute(d.take_due_entries, arg).all())
    if len(rows) < limit:
        rows += conn.execute(d.take_due_overflow, {**arg, "limit": limit - len(rows)}).all()
    return rows


def due_bound(conn: Connection, sch: StorageSchema, limit: int) -> DueKey:
    """The key of the ``limit``-th due wait of unpaused queues across both deferred states
    (wheel and overflow; by ``run_at``, then priority and job id), or :data:`NO_DUE_BOUND`
    when fewer are due: taking each state's waits up to it takes the ``limit`` waits due
    first, whatever their states."""
    row = conn.execute(deferred_statements(sch).due_bound, {"limit": limit, "skip": limit - 1}).first()
    return NO_DUE_BOUND if row is None else (row[0], int(row[1]), int(row[2]))


def advance_overflow(conn: Connection, sch: StorageSchema, limit: int) -> int:
    """Move up to ``limit`` overflow rows that have come within the wheel's span into the
    wheel (earliest ``run_at`` first; rows locked by others are skipped): one delete per
    row, the only dead tuple of the deferred backlog. Returns how many moved."""
    return int(conn.execute(deferred_statements(sch).advance, {"limit": limit}).scalar_one())


def wheel_bucket_now(conn: Connection, sch: StorageSchema, at: datetime | None = None) -> int:
    """The wheel's current bucket on the server's clock (or at ``at``)."""
    return int(conn.execute(deferred_statements(sch).bucket_now, {"at": at}).scalar_one())


def lock_wheel_slot(conn: Connection, sch: StorageSchema, slot: int) -> None:
    """``ACCESS EXCLUSIVE`` on the wheel's and the marks' children of ``slot``."""
    prep = conn.dialect.identifier_preparer
    names = ", ".join(prep.format_table(t) for t in (sch.wheel.children[slot], sch.wheel_marks.children[slot]))
    conn.execute(text(f"LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE"))


def wheel_slot_unresolved(conn: Connection, sch: StorageSchema, slot: int) -> int:
    """Entries of wheel ``slot`` without a mark (saturating at 10,000)."""
    return int(conn.execute(_wheel_slot(sch, slot).unresolved).scalar_one())


def wheel_slot_written(conn: Connection, sch: StorageSchema, slot: int) -> bool:
    """Whether anything was written to wheel ``slot``'s children since they were created or
    last truncated (a heap of more than zero bytes)."""
    return any(conn.execute(_wheel_slot(sch, slot).sizes).one())


def truncate_wheel_slot(conn: Connection, sch: StorageSchema, slot: int) -> None:
    """``TRUNCATE`` the wheel's and the marks' children of ``slot`` in one statement. Call it
    under :func:`lock_wheel_slot`, after checking that every entry is resolved."""
    prep = conn.dialect.identifier_preparer
    names = ", ".join(prep.format_table(t) for t in (sch.wheel.children[slot], sch.wheel_marks.children[slot]))
    conn.execute(text(f"TRUNCATE {names}"))


def take_dlq(conn: Connection, sch: StorageSchema, job_id: int) -> list[Any]:
    """Delete and return the job's DLQ row."""
    return list(conn.execute(statements(sch).take_dlq, {"b_job": job_id}).all())


def take_dlq_where(conn: Connection, sch: StorageSchema, pick: Select[Any]) -> list[Any]:
    """Delete and return the DLQ rows whose job ids ``pick`` selects."""
    q = sch.dlq
    return list(conn.execute(q.delete().where(q.c.job_id.in_(pick.scalar_subquery())).returning(*q.c)).all())


def discard_dlq_kind(conn: Connection, sch: StorageSchema, kind: str) -> list[Any]:
    """Delete every DLQ row of ``kind``; returns their ``(job_id, unique_key)``."""
    return discard_dlq_where(conn, sch, sch.dlq.c.kind == kind)


def discard_dlq_where(conn: Connection, sch: StorageSchema, *where: Any) -> list[Any]:
    """Delete every DLQ row matching ``where`` (all rows without a criterion); returns their
    ``(job_id, unique_key)``."""
    q = sch.dlq
    return list(conn.execute(q.delete().where(*where).returning(q.c.job_id, q.c.unique_key)).all())


# -- the deferred wheel ---------------------------------------------------------------------
#: A job snapshot as the deferred backlog stores it (wheel entries and overflow rows alike).
SNAPSHOT_COLUMNS: dict[str, Any] = {
    "job_id": BigInteger(), "kind": Text(), "queue": Text(), "args": JSONB(), "state": Text(),
    "priority": SmallInteger(), "attempt": SmallInteger(), "run_lease": BigInteger(),
    "max_attempts": SmallInteger(), "run_at": TIMESTAMP(timezone=True),
    "attempted_at": TIMESTAMP(timezone=True), "finalized_at": TIMESTAMP(timezone=True),
    "created_at": TIMESTAMP(timezone=True), "unique_key": BYTEA(), "unique_states": Text(),
    "payload": OPTIONAL_JSON,
}


@dataclass(frozen=True)
class DeferredStatements:
    """The deferred backlog's statements for one install, built once."""

    defer: Insert
    take_entry: Select[Any]
    take_overflow: ReturningDelete[Any]
    take_due_entries: Select[Any]
    take_due_overflow: ReturningDelete[Any]
    due_bound: Select[Any]
    due_probes: dict[str, HotStatement]
    advance: Select[Any]
    bucket_now: Select[Any]


def _bucket_of(at: Any) -> Any:
    return func.floor(func.extract("epoch", at) / WHEEL_BUCKET_SECONDS).cast(BigInteger)


@functools.lru_cache(maxsize=64)
def deferred_statements(sch: StorageSchema) -> DeferredStatements:
    w, mk, df, m = sch.wheel.parent, sch.wheel_marks.parent, sch.deferred, sch.queue_meta
    now = func.clock_timestamp()
    state_type = df.c.state.type
    names = list(SNAPSHOT_COLUMNS)

    def snapshot(src: Any) -> list[Any]:
        return [src.c.state.cast(state_type) if c == "state" else
                func.coalesce(src.c.created_at, now) if c == "created_at" else src.c[c] for c in names]

    def into_wheel(src: Any, where: Any) -> Insert:
        return insert(w).from_select(
            ["wheel_slot", "bucket", *names],
            select((src.c.bucket % WHEEL_SLOTS).cast(SmallInteger), src.c.bucket, *snapshot(src)).where(where))

    # new waits: each into its wheel bucket, or into the overflow beyond the span
    u = unnest_rows("d", **SNAPSHOT_COLUMNS)
    src = select(*u.c, schema_func(sch, "wheel_bucket", u.c.run_at).label("bucket")).cte("src")
    to_wheel = into_wheel(src, src.c.bucket.isnot(None)).cte("to_wheel")
    defer = insert(df).from_select(names, select(*snapshot(src)).where(src.c.bucket.is_(None))).add_cte(to_wheel)

    # taking a live entry: a mark that lands (ON CONFLICT DO NOTHING) owns it. Every taker
    # first locks the entry row: one taking a single job waits for that lock, a promotion
    # skips entries locked by others. A promotion so never waits for another transaction's
    # mark while it holds marks of its own, which would deadlock with a transaction that
    # takes two entries in the other order (a multi-job cancel, say).
    unmarked = wheel_entry_live(w, mk)
    states: Any = bindparam("states", expanding=True)

    def claimed(candidates: Any, resolution: Any) -> Select[Any]:
        won = (pg_insert(mk).from_select(
            ["wheel_slot", "entry_id", "job_id", "resolution"],
            select(candidates.c.wheel_slot, candidates.c.entry_id, candidates.c.job_id, resolution))
            .on_conflict_do_nothing().returning(mk.c.wheel_slot, mk.c.entry_id).cte("won"))
        return select(*(w.c[c] for c in names)).select_from(
            w.join(won, and_(won.c.entry_id == w.c.entry_id, won.c.wheel_slot == w.c.wheel_slot)))

    job = bindparam("b_job", type_=BigInteger())
    entry = select(w.c.wheel_slot, w.c.entry_id, w.c.job_id).where(
        w.c.job_id == job, w.c.state.in_(states), unmarked).with_for_update(of=w).cte("entry")
    take_entry = claimed(entry, bindparam("resolution", type_=Text()))

    def paused(queue: Any) -> Any:
        return select(m.c.queue).where(m.c.queue == func.regexp_replace(queue, "#[0-9]+$", ""), m.c.paused).exists()

    # Due means run_at <= the statement's start: a stable value, so the (state, run_at, ...)
    # indexes bound the scan to due entries (clock_timestamp() is volatile and would be a
    # filter over every waiting entry of the state)
    due_at = func.statement_timestamp()
    limit = bindparam("limit", type_=Integer())
    upto = tuple_(bindparam("upto_run_at", type_=TIMESTAMP(timezone=True)),
                  bindparam("upto_priority", type_=SmallInteger()), bindparam("upto_job", type_=BigInteger()))

    def key(t: Any) -> list[Any]:
        return [t.c.run_at, t.c.priority, t.c.job_id]

    def first_due(t: Any, state: Any, columns: Sequence[Any], *conds: Any) -> Select[Any]:
        """The first ``limit`` due waits of ``state`` in ``t`` (the wheel or the overflow)
        of unpaused queues, in promotion order, locked; waits other takers hold are
        skipped (every promotion statement reads the due waits through this)."""
        return (select(*columns).where(t.c.state == state, t.c.run_at <= due_at, *conds, ~paused(t.c.queue))
                .order_by(*key(t)).limit(limit).with_for_update(of=t, skip_locked=True))

    state: Any = bindparam("state")
    due = first_due(w, state, [w.c.wheel_slot, w.c.entry_id, w.c.job_id], tuple_(*key(w)) <= upto,
                    unmarked).cte("due")
    take_due_entries = claimed(due, literal(WheelResolution.PROMOTED.value, Text()))

    due_overflow = first_due(df, state, [df.c.job_id], tuple_(*key(df)) <= upto)
    take_due_overflow = df.delete().where(df.c.job_id.in_(due_overflow.scalar_subquery())).returning(*df.c)

    # the key of the limit-th wait due first across both states: each state's own first
    # `limit` waits in the wheel and in the overflow (four index scans), merged. Each scan
    # locks what it reads and skips what other takers hold, as the takes do: a wait held
    # elsewhere (a cancel in progress) neither counts toward the bound nor is taken, so
    # waits held by others never keep the promotion from the rest. The takes that follow
    # in the same transaction find these rows locked by their own transaction.
    firsts = union_all(*(select(*c.c) for c in (
        first_due(t, st, key(t), *live).cte(f"first_{t.name}_{st}") for t, live in ((w, (unmarked,)), (df, ()))
        for st in (JobState.SCHEDULED.value, JobState.RETRYABLE.value)))).subquery("firsts")
    due_bound = (select(firsts.c.run_at, firsts.c.priority, firsts.c.job_id)
                 .order_by(firsts.c.run_at, firsts.c.priority, firsts.c.job_id)
                 .offset(bindparam("skip", type_=Integer())).limit(1))

    # whether a take would find anything: the same conditions, no order, no lock, no write;
    # one parameterless statement per state, prepared (planned once per connection)
    def probe(state: str) -> HotStatement:
        in_wheel = select(w.c.entry_id).where(w.c.state == state, w.c.run_at <= due_at, unmarked, ~paused(w.c.queue))
        in_overflow = select(df.c.job_id).where(df.c.state == state, df.c.run_at <= due_at, ~paused(df.c.queue))
        return HotStatement(select(or_(in_wheel.exists(), in_overflow.exists())), prepared=True)

    due_probes = {st.value: probe(st.value) for st in (JobState.SCHEDULED, JobState.RETRYABLE)}

    # overflow rows within the span move into the wheel (bucket < current + span)
    span_end = func.to_timestamp(((_bucket_of(now) + (WHEEL_SLOTS - WHEEL_GUARD_SLOTS)) * WHEEL_BUCKET_SECONDS)
                                 .cast(BigInteger))
    near = (select(df.c.job_id).where(df.c.state.in_(["scheduled", "retryable"]), df.c.run_at < span_end)
            .order_by(df.c.run_at).limit(limit).with_for_update(skip_locked=True))
    moved = df.delete().where(df.c.job_id.in_(near.scalar_subquery())).returning(*df.c).cte("moved")
    # every row deleted lands in the wheel: its bucket is within the span by the choice above
    # (the clock only moves on), the bucket of its run_at should the function ever disagree
    mv = select(*moved.c, func.coalesce(schema_func(sch, "wheel_bucket", moved.c.run_at),
                                        _bucket_of(moved.c.run_at)).label("bucket")).cte("mv")
    placed = into_wheel(mv, true()).returning(w.c.entry_id).cte("placed")
    advance = select(func.count()).select_from(placed)

    at = bindparam("at", type_=TIMESTAMP(timezone=True))
    return DeferredStatements(
        defer=defer, take_entry=take_entry,
        take_overflow=df.delete().where(df.c.job_id == job, df.c.state.in_(states)).returning(*df.c),
        take_due_entries=take_due_entries, take_due_overflow=take_due_overflow, due_bound=due_bound,
        due_probes=due_probes,
        advance=advance,
        bucket_now=select(_bucket_of(func.coalesce(at, now))),
    )


@dataclass(frozen=True)
class WheelSlot:
    unresolved: Select[Any]
    sizes: Select[Any]


@functools.lru_cache(maxsize=1024)
def _wheel_slot(sch: StorageSchema, slot: int) -> WheelSlot:
    w, mk = sch.wheel.children[slot], sch.wheel_marks.children[slot]
    unmarked = ~select(mk.c.entry_id).where(mk.c.entry_id == w.c.entry_id).exists()
    prep = postgresql.dialect().identifier_preparer
    return WheelSlot(
        unresolved=select(func.count()).select_from(select(w.c.entry_id).where(unmarked).limit(10_000).subquery()),
        sizes=select(*(func.pg_relation_size(literal(f"{prep.quote_schema(sch.config.schema)}.{prep.quote(t.name)}",
                                                     REGCLASS()))
                       for t in (w, mk))),
    )
