"""Queue plane: the only Python writer of the queue ring (ready entries, tombstones, done
entries, terminal count deltas), the deferred backlog and the DLQ.

Ready entries are immutable (a job that moves gets a new row and a tombstone on the old
one), and every row carries the ring ``(slot, generation)`` it was written at: writers read
the ring cursor in the inserting statement (COPY, which cannot, reads it just before).
Every done-row insert or delete appends a signed terminal-count delta in the same
transaction; nothing here updates a counter row. NOTIFY wake-ups are transactional: they
are delivered when the writing transaction commits.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import (
    BigInteger,
    Connection,
    Insert,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    func,
    insert,
    literal,
    literal_column,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, REGCLASS, TIMESTAMP
from sqlalchemy.sql.dml import ReturningDelete, Update
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.util.concurrency import await_

from qstore.config import COUNTER_BUCKETS
from qstore.schema import StorageSchema
from qstore.schema.types import OPTIONAL_JSON
from qstore.storage.bodies import Body
from qstore.storage.columns import body_values
from qstore.storage.jobs import PreparedJob
from qstore.storage.statements import unnest_rows
from qstore.types import JobState

__all__ = [
    "QueueStatements",
    "allocate_ids",
    "copy_ready",
    "delete_done",
    "insert_deferred",
    "insert_ready",
    "notify",
    "notify_queues",
    "select_done",
    "statements",
    "tombstone",
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
DEFERRED_COLUMNS: dict[str, Any] = {
    "job_id": BigInteger(), "kind": Text(), "queue": Text(), "args": JSONB(), "state": Text(),
    "priority": SmallInteger(), "attempt": SmallInteger(), "run_lease": BigInteger(),
    "max_attempts": SmallInteger(), "run_at": TIMESTAMP(timezone=True),
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
    deferred: Insert
    notify: Select[Any]
    tombstone: Insert
    done_base: Select[Any]
    take_deferred: ReturningDelete[Any]
    take_due: ReturningDelete[Any]
    update_scheduled: Update
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
    dv = unnest_rows("d", **DEFERRED_COLUMNS)
    deferred_sel = select(
        *(dv.c[c] if c != "state" else dv.c.state.cast(sch.deferred.c.state.type)
          for c in DEFERRED_COLUMNS if c != "created_at"),
        func.coalesce(dv.c.created_at, now),
    )
    deferred_cols = [c for c in DEFERRED_COLUMNS if c != "created_at"] + ["created_at"]
    n = unnest_rows("n", channel=Text())
    t = sch.tombstones.parent
    d, r = sch.done.parent, sch.ready.parent
    join = and_(r.c.ready_slot == d.c.ready_slot, r.c.ready_generation == d.c.ready_generation,
                r.c.queue == d.c.queue, r.c.priority == d.c.priority,
                r.c.enqueue_shard == d.c.enqueue_shard, r.c.lane_seq == d.c.lane_seq)
    cols = [d.c.ready_slot, d.c.ready_generation, d.c.job_id, d.c.kind, d.c.queue, d.c.state,
            d.c.priority, d.c.attempt, d.c.run_lease, d.c.lane_seq, d.c.enqueue_shard,
            d.c.attempted_at, d.c.finalized_at]
    # a JSON null payload (what an older release's general terminal path wrote) is absent
    hyd = [func.coalesce(*((func.nullif(d.c[c], _JSON_NULL), func.nullif(r.c[c], _JSON_NULL))
                           if c == "payload" else (d.c[c], r.c[c]))).label(c)
           for c in _HYDRATED]
    df, q, m = sch.deferred, sch.dlq, sch.queue_meta
    job = bindparam("b_job", type_=BigInteger())
    paused = select(m.c.queue).where(m.c.queue == func.regexp_replace(df.c.queue, "#[0-9]+$", ""),
                                     m.c.paused).exists()
    due = (select(df.c.job_id).where(df.c.state == bindparam("state"), df.c.run_at <= now, ~paused)
           .order_by(df.c.run_at, df.c.priority, df.c.job_id).limit(bindparam("limit", type_=Integer()))
           .with_for_update(skip_locked=True))
    return QueueStatements(
        # A bound regclass, not Sequence.next_value(): SQLAlchemy's cache key of
        # next_value() omits the sequence's schema, so two installs on one Engine would
        # share one plan.
        ids=select(func.nextval(literal(f"{sch.config.schema}.{sch.job_id_seq.name}", REGCLASS())))
        .select_from(func.generate_series(1, bindparam("n", type_=Integer()))),
        ring=select(rs.c.current_slot, rs.c.generation),
        ready=insert(sch.ready.parent).from_select(ready_cols, ready_sel),
        deferred=insert(sch.deferred).from_select(deferred_cols, deferred_sel),
        notify=select(func.count(func.pg_notify(n.c.channel, ""))).select_from(n),
        tombstone=insert(t).values(
            ready_slot=bindparam("k_slot"), ready_generation=bindparam("k_gen"),
            queue=bindparam("k_queue"), priority=bindparam("k_priority"),
            enqueue_shard=bindparam("k_shard"), lane_seq=bindparam("k_seq"), job_id=job),
        done_base=select(*cols, *hyd).select_from(d.outerjoin(r, join)),
        take_deferred=df.delete().where(df.c.job_id == job, df.c.state.in_(bindparam("states", expanding=True)))
        .returning(*df.c),
        take_due=df.delete().where(df.c.job_id.in_(due.scalar_subquery())).returning(*df.c),
        update_scheduled=update(df).where(df.c.job_id == job).values(
            queue=bindparam("n_queue"), priority=bindparam("n_priority"), payload=bindparam("n_payload")),
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
    """New scheduled jobs (``run_at`` in the future) into the deferred backlog."""
    conn.execute(statements(sch).deferred, {
        "job_id": [r.job_id for r in rows], "kind": [r.kind for r in rows],
        "queue": [r.queue for r in rows], "args": [r.args for r in rows],
        "state": [JobState.SCHEDULED.value] * len(rows), "priority": [r.priority for r in rows],
        "attempt": [0] * len(rows), "run_lease": [0] * len(rows),
        "max_attempts": [r.max_attempts for r in rows],
        "run_at": [r.run_at for r in rows], "created_at": [None] * len(rows),
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
    """``(body, scheduled|retryable, run_at, finalized_at)`` rows into the deferred backlog."""
    if not items:
        return
    conn.execute(insert(sch.deferred), [{
        **body_values(b.job), "state": st.value, "run_at": run_at, "finalized_at": fin,
    } for b, st, run_at, fin in items])


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
def take_deferred(conn: Connection, sch: StorageSchema, job_id: int, states: Sequence[JobState]) -> list[Any]:
    """Delete and return the job's deferred row if it is in one of ``states``."""
    return list(conn.execute(statements(sch).take_deferred, {"b_job": job_id, "states": list(states)}).all())


def take_due(conn: Connection, sch: StorageSchema, state: JobState, limit: int) -> list[Any]:
    """Delete and return up to ``limit`` due deferred rows in ``state`` of unpaused queues
    (oldest ``run_at`` first; rows locked by others are skipped). ``RETURNING`` keeps no
    order."""
    return list(conn.execute(statements(sch).take_due, {"state": state.value, "limit": limit}).all())


def move_scheduled(conn: Connection, sch: StorageSchema, job_id: int, queue: str, priority: int,
                   payload: Any) -> None:
    """Re-queue / re-prioritise a scheduled job in the backlog (its row is locked)."""
    conn.execute(statements(sch).update_scheduled, {"b_job": job_id, "n_queue": queue,
                                                    "n_priority": priority, "n_payload": payload})


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
