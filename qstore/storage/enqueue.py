"""Enqueue: ``enqueue_params_batch`` (one multi-row INSERT), ``enqueue_params_copy`` (COPY)
and ``enqueue_batch`` (synthetic benchmark jobs).

One transaction per call: validate everything first, allocate ids, take unique keys,
reserve lane positions (the lane reservation lock is transaction-scoped and held until the
enqueue commits — trap T1), write ready rows into the current queue slot and deferred rows,
then NOTIFY each logical queue that received ready rows (PostgreSQL delivers it on commit).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    SmallInteger,
    Text,
    bindparam,
    func,
    insert,
    literal,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, REGCLASS, TIMESTAMP
from sqlalchemy.util.concurrency import await_

from qstore.schema import StorageSchema
from qstore.schema.types import OPTIONAL_JSON
from qstore.storage import unique
from qstore.storage._tx import reads_committed_state
from qstore.storage.jobs import PreparedJob, shard_for_ordering_key
from qstore.storage.statements import packed_array_param, schema_func, unnest_rows

__all__ = ["ENQUEUE_COLUMNS", "LaneRouter", "ReadyRow", "notify_queues", "write_jobs"]

ENQUEUE_COLUMNS: dict[str, Any] = {
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
SHARD_CACHE_TTL = 5.0

ReadyRow = dict[str, Any]


@functools.lru_cache(maxsize=64)
def statements(sch: StorageSchema) -> dict[str, Any]:
    """Core statements of the enqueue path, built once per install."""
    rs = sch.queue_ring.state
    u = unnest_rows("u", **ENQUEUE_COLUMNS)
    now = func.clock_timestamp()
    ready_sel = select(
        rs.c.current_slot, rs.c.generation,
        *(u.c[c] for c in ENQUEUE_COLUMNS if c != "created_at"),
        func.coalesce(u.c.created_at, now), now,
    ).select_from(rs.join(u, true()))
    ready_cols = ["ready_slot", "ready_generation",
                  *(c for c in ENQUEUE_COLUMNS if c != "created_at"), "created_at", "run_at"]
    d = unnest_rows("d", **DEFERRED_COLUMNS)
    deferred_sel = select(
        *(d.c[c] if c != "state" else d.c.state.cast(sch.deferred.c.state.type)
          for c in DEFERRED_COLUMNS if c != "created_at"),
        func.coalesce(d.c.created_at, now),
    )
    deferred_cols = [c for c in DEFERRED_COLUMNS if c != "created_at"] + ["created_at"]
    n = unnest_rows("n", channel=Text())
    return {
        # A bound regclass, not Sequence.next_value(): SQLAlchemy's cache key of next_value()
        # omits the sequence's schema, so two installs on one Engine would share one plan.
        "ids": select(func.nextval(literal(f"{sch.config.schema}.{sch.job_id_seq.name}", REGCLASS()))).select_from(
            func.generate_series(1, bindparam("n", type_=Integer()))),
        "reserve": select(schema_func(
            sch, "reserve_lanes",
            packed_array_param("queues", Text()), packed_array_param("logicals", Text()),
            packed_array_param("priorities", SmallInteger()), packed_array_param("shards", SmallInteger()),
            packed_array_param("counts", Integer()),
        )),
        "ready": insert(sch.ready.parent).from_select(ready_cols, ready_sel),
        "deferred": insert(sch.deferred).from_select(deferred_cols, deferred_sel),
        "ring": select(rs.c.current_slot, rs.c.generation),
        "notify": select(func.count(func.pg_notify(n.c.channel, ""))).select_from(n),
        "shards": select(sch.queue_meta.c.queue, sch.queue_meta.c.enqueue_shards).where(
            sch.queue_meta.c.queue.in_(bindparam("logicals", expanding=True))),
    }


class LaneRouter:
    """Per-process routing state: the shard rotor and a short-lived cache of
    ``queue_meta.enqueue_shards`` keyed by *logical* queue (trap T11)."""

    def __init__(self) -> None:
        self._rotor = itertools.count()
        self._shards: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()

    def shard_counts(self, conn: Connection, sch: StorageSchema, logicals: set[str]) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            known = {q: v for q, (t, v) in self._shards.items() if q in logicals and now - t < SHARD_CACHE_TTL}
        missing = sorted(logicals - known.keys())
        if missing:
            found = {q: n for q, n in conn.execute(statements(sch)["shards"], {"logicals": missing})}
            for q in missing:
                known[q] = int(found.get(q, 1))
            # inside a caller's transaction the read may see its own uncommitted queue
            # options, which a rollback would take back: use them, do not keep them
            if reads_committed_state(conn):
                with self._lock:
                    for q in missing:
                        self._shards[q] = (now, known[q])
        return known

    def next_rotor(self) -> int:
        return next(self._rotor)


def assign_lanes(
    conn: Connection, sch: StorageSchema, router: LaneRouter, rows: Sequence[PreparedJob]
) -> None:
    """Choose each ready row's shard and reserve consecutive lane positions per lane.

    Rows with an ordering key are pinned to ``shard_for_ordering_key``; key-less rows of a
    ``(queue, priority)`` group share one rotor pick. Lanes are reserved in sorted order (the
    lock order every enqueue follows), FIFO within a lane = batch order.
    """
    if not rows:
        return
    shard_counts = router.shard_counts(conn, sch, {r.logical for r in rows})
    rotor_pick: dict[tuple[str, int], int] = {}
    lanes: dict[tuple[str, int, int], list[PreparedJob]] = defaultdict(list)
    for row in rows:
        shards = shard_counts.get(row.logical, 1)
        if shards <= 1:
            row.shard = 0
        elif row.ordering_key is not None:
            row.shard = shard_for_ordering_key(row.ordering_key, shards)
        else:
            pick = (row.queue, row.priority)
            if pick not in rotor_pick:
                rotor_pick[pick] = router.next_rotor() % shards
            row.shard = rotor_pick[pick]
        lanes[(row.queue, row.priority, row.shard)].append(row)
    order = sorted(lanes)
    starts = conn.execute(statements(sch)["reserve"], {
        "queues": [q for q, _, _ in order],
        "logicals": [lanes[k][0].logical for k in order],
        "priorities": [p for _, p, _ in order],
        "shards": [s for _, _, s in order],
        "counts": [len(lanes[k]) for k in order],
    }).scalar_one()
    for key, start in zip(order, starts, strict=True):
        for offset, row in enumerate(lanes[key]):
            row.lane_seq = start + offset


def allocate_ids(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob]) -> None:
    ids = conn.execute(statements(sch)["ids"], {"n": len(rows)}).scalars().all()
    for row, job_id in zip(rows, ids, strict=True):
        row.job_id = job_id


def ready_params(rows: Sequence[PreparedJob], attempts: Sequence[int] | None = None,
                 run_leases: Sequence[int] | None = None, created: Sequence[Any] | None = None) -> dict[str, list[Any]]:
    n = len(rows)
    return {
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
    }


def notify_queues(conn: Connection, sch: StorageSchema, logicals: set[str]) -> None:
    """Transactional wake-up: PostgreSQL delivers it only if the transaction commits."""
    if logicals:
        channels = sorted(sch.config.notify_channel(q) for q in logicals)
        conn.execute(statements(sch)["notify"], {"channel": channels})


def write_jobs(
    conn: Connection, sch: StorageSchema, router: LaneRouter, rows: Sequence[PreparedJob],
    *, use_copy: bool = False,
) -> int:
    """Write new jobs (already validated) on ``conn``'s transaction. Returns rows written."""
    if not rows:
        return 0
    allocate_ids(conn, sch, rows)
    owners = [(r.unique_key, r.job_id) for r in rows
              if r.unique_key is not None and unique.holds(r.unique_states, r.state)]
    if owners:
        unique.acquire(conn, sch, owners)
    ready = [r for r in rows if r.run_at is None]
    deferred = [r for r in rows if r.run_at is not None]
    assign_lanes(conn, sch, router, ready)
    if ready:
        if use_copy:
            _copy_ready(conn, sch, ready)
        else:
            conn.execute(statements(sch)["ready"], ready_params(ready))
    if deferred:
        conn.execute(statements(sch)["deferred"], {
            "job_id": [r.job_id for r in deferred], "kind": [r.kind for r in deferred],
            "queue": [r.queue for r in deferred], "args": [r.args for r in deferred],
            "state": ["scheduled"] * len(deferred), "priority": [r.priority for r in deferred],
            "attempt": [0] * len(deferred), "run_lease": [0] * len(deferred),
            "max_attempts": [r.max_attempts for r in deferred],
            "run_at": [r.run_at for r in deferred], "created_at": [None] * len(deferred),
            "unique_key": [r.unique_key for r in deferred],
            "unique_states": [r.unique_states for r in deferred],
            "payload": [r.payload for r in deferred],
        })
    notify_queues(conn, sch, {r.logical for r in ready})
    return len(rows)


_COPY_FIELDS = ("ready_slot", "ready_generation", "job_id", "kind", "queue", "args", "priority",
                "attempt", "run_lease", "max_attempts", "lane_seq", "enqueue_shard",
                "unique_key", "unique_states", "payload")


def _copy_ready(conn: Connection, sch: StorageSchema, rows: Sequence[PreparedJob]) -> None:
    """Stream ready rows with ``COPY … FROM STDIN`` on the caller's connection.

    COPY cannot read the ring cursor itself, so it is read in the same transaction just
    before. A row that lands in a slot the ring has since sealed is legal: every row carries
    its own (slot, generation), and prune gates examine every physical row of a child
    regardless of generation (trap T7).
    """
    slot, generation = conn.execute(statements(sch)["ring"]).one()
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
    if isinstance(raw, psycopg.AsyncConnection):  # async engine, reached through run_sync
        await_(_copy_async(raw, sql, values))
        return
    with raw.cursor() as cur, cur.copy(sql) as cp:
        for v in values:
            cp.write_row(v)


async def _copy_async(raw: Any, sql: str, values: Sequence[tuple[Any, ...]]) -> None:
    async with raw.cursor() as cur, cur.copy(sql) as cp:
        for v in values:
            await cp.write_row(v)
