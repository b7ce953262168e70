"""What an install holds right now: per-queue counts, ring cursors and table health.

Everything here reads; nothing writes. The functions take an ``Engine``, on which they read
in one ``REPEATABLE READ``, read-only transaction (the ``SNAPSHOT`` policy), so every count
of a report comes from one snapshot; or a ``Connection`` or ORM ``Session``, whose
transaction they join and never commit. Either way their first statement takes ``ACCESS
SHARE`` on every table upkeep truncates (:func:`hold_rings`) and holds it until the
transaction ends: ``TRUNCATE`` is not MVCC-safe, and a prune committing after the snapshot
would otherwise make the history it truncated vanish from the counts (its rollup-ledger row
is invisible to that snapshot). A prune or counter rollup that meets a status read reports
``Blocked`` after its 50 ms lock timeout; enqueues, claims and completions do not wait for
it. On a caller's connection, one snapshot needs a ``REPEATABLE READ`` transaction in which
the status read (or :func:`hold_rings`) runs first.

* :func:`queue_status` — per logical queue: ``available``, ``running`` and ``terminal`` from
  the storage's own counts (``queue_counts``, or ``queue_counts_fast`` when ``exact`` is
  False, with its documented bounds), ``waiting_external`` (attempts parked on a callback),
  ``scheduled`` and ``retryable`` (the deferred backlog), the terminal rows still retained
  in the queue ring by state (``completed`` / ``cancelled`` / ``failed``; None when not
  ``exact``: they need a scan), the DLQ depth, the pause flag and the lane count. Queues are
  every logical queue with a lane, options, a deferred, retained terminal or DLQ row.
* :func:`ring_status` — per ring (queue, lease, claim): its cursor (current slot,
  generation, slot count) and per slot the generation it last had and the bytes its children
  take (a slot holding data is not yet reclaimed).
* :func:`schema_health` — live tuples, dead tuples (``pg_stat_user_tables.n_dead_tup``: the
  statistics collector's estimate, which each session flushes at most once a second) and
  total bytes (heap, indexes and TOAST) per table family of the install, restricted to its
  schema. Families: :data:`FAMILIES`.
* :func:`handed_back_kinds` — per queue and kind, the jobs waiting out a hand-back by a
  worker that had no task for their kind: scheduled jobs whose last attempt was given back
  that way (the worker records each such hand-back in the job's progress under
  :data:`UNHANDLED_KEY`, with the attempt's ``run_lease``; a record left from an earlier
  attempt does not count).
* :func:`status_report` — all of the above, plus the install's shape and counter trust.

``as_dict()`` of each report gives JSON-ready values under stable keys.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sqlalchemy import (
    CompoundSelect,
    Connection,
    Integer,
    Select,
    Table,
    Text,
    bindparam,
    case,
    cast,
    column,
    func,
    literal,
    select,
    table,
    union_all,
)

from qstore.errors import translate_errors
from qstore.schema import Ring, StorageSchema
from qstore.schema.queue_plane import batch_member_total
from qstore.storage import QueueStorage
from qstore.storage.jobs import logical_queue
from qstore.storage.planes.rings import regclass, slot_generation
from qstore.storage.read import truncated_by_upkeep
from qstore.storage.statements import live_deferred
from qstore.storage.targets import Policy, Target, hold, run
from qstore.types import JobState

__all__ = [
    "FAMILIES",
    "UNHANDLED_KEY",
    "FamilyHealth",
    "HandedBack",
    "QueueStatus",
    "RingStatus",
    "SchemaHealth",
    "SlotStatus",
    "StatusReport",
    "TableHealth",
    "family_of_tables",
    "handed_back_kinds",
    "hold_rings",
    "queue_names",
    "queue_status",
    "ring_status",
    "schema_health",
    "status_report",
]

R = TypeVar("R")

#: Table families of :func:`schema_health`, in report order: the queue ring's ready side
#: (ready entries, tombstones, claim ranges) and done side (done entries, terminal count
#: deltas), the lease ring, the claim ring (receipts, closures), the hot control tables
#: (lanes, enqueue/claim heads, attempt state, claimer leases), the counters, the deferred
#: wheel (entries and marks), the backlogs (the deferred overflow, DLQ, unique keys and their
#: releases) and
#: every other table of the schema.
FAMILIES = ("queue_ready", "queue_done", "lease_ring", "claim_ring", "hot", "counters", "deferred_wheel",
            "backlog", "other")
#: The key of a job's progress under which a worker that has no task for the job's kind
#: records giving the attempt back: ``{"count": n, "run_lease": r, "at": iso-time}``.
UNHANDLED_KEY = "qstore.unhandled"


# -- reports ------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueStatus:
    """One logical queue (see the module docstring for what each count is)."""

    queue: str
    available: int
    running: int
    waiting_external: int
    scheduled: int
    retryable: int
    terminal: int
    completed: int | None
    cancelled: int | None
    failed: int | None
    dlq: int
    paused: bool
    lanes: int

    @property
    def waiting(self) -> int:
        """Jobs waiting for their time: scheduled plus retryable."""
        return self.scheduled + self.retryable

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "waiting": self.waiting}


@dataclass(frozen=True)
class SlotStatus:
    """One ring slot: the generation it last had (None: never current yet), its children's
    heap bytes (0: nothing written since they were created or last truncated) and their
    total bytes (heap, indexes, TOAST)."""

    slot: int
    generation: int | None
    current: bool
    heap_bytes: int
    bytes: int


@dataclass(frozen=True)
class RingStatus:
    """One ring's cursor and slots."""

    name: str
    current_slot: int
    generation: int
    slot_count: int
    slots: tuple[SlotStatus, ...]

    @property
    def slots_holding_data(self) -> int:
        """Slots written since they were created or last reclaimed (any heap page)."""
        return sum(1 for s in self.slots if s.heap_bytes > 0)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.slots)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "current_slot": self.current_slot, "generation": self.generation,
                "slot_count": self.slot_count, "slots_holding_data": self.slots_holding_data,
                "bytes": self.bytes, "slots": [asdict(s) for s in self.slots]}


@dataclass(frozen=True)
class TableHealth:
    """One table of the schema (a ring child, an unpartitioned table)."""

    name: str
    family: str
    live_tuples: int
    dead_tuples: int
    bytes: int


@dataclass(frozen=True)
class FamilyHealth:
    """The sums over one family's tables."""

    name: str
    tables: int
    live_tuples: int
    dead_tuples: int
    bytes: int


@dataclass(frozen=True)
class SchemaHealth:
    """Tuples and bytes of every table of one install's schema, by family (every family of
    :data:`FAMILIES` is present, in that order, possibly with zero tables)."""

    schema: str
    families: tuple[FamilyHealth, ...]
    tables: tuple[TableHealth, ...]

    @property
    def dead_tuples(self) -> int:
        return sum(f.dead_tuples for f in self.families)

    @property
    def live_tuples(self) -> int:
        return sum(f.live_tuples for f in self.families)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.families)

    def family(self, name: str) -> FamilyHealth:
        """The family called ``name`` (one of :data:`FAMILIES`)."""
        for f in self.families:
            if f.name == name:
                return f
        raise KeyError(name)

    def as_dict(self, *, tables: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": self.schema,
            "families": {f.name: {"tables": f.tables, "live_tuples": f.live_tuples,
                                  "dead_tuples": f.dead_tuples, "bytes": f.bytes}
                         for f in self.families},
            "total": {"tables": len(self.tables), "live_tuples": self.live_tuples,
                      "dead_tuples": self.dead_tuples, "bytes": self.bytes},
        }
        if tables:
            out["tables"] = [asdict(t) for t in self.tables]
        return out


@dataclass(frozen=True)
class HandedBack:
    """Jobs of one queue and kind that wait out a hand-back by a worker without a task for
    their kind: ``jobs`` scheduled jobs whose last attempt was handed back that way, the
    most hand-backs one of them had in a row (``most``) and the latest hand-back's time
    (ISO text, as the worker recorded it)."""

    queue: str
    kind: str
    jobs: int
    most: int
    last_at: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StatusReport:
    """:func:`status_report`: queues, rings and health of one install, with its shape."""

    schema: str
    exact: bool
    counters_trusted: bool
    shape: dict[str, Any]
    queues: tuple[QueueStatus, ...]
    rings: tuple[RingStatus, ...]
    health: SchemaHealth
    handed_back: tuple[HandedBack, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"schema": self.schema, "exact": self.exact, "counters_trusted": self.counters_trusted,
                "shape": dict(self.shape), "queues": [q.as_dict() for q in self.queues],
                "rings": [r.as_dict() for r in self.rings], "health": self.health.as_dict(),
                "handed_back": [h.as_dict() for h in self.handed_back]}


# -- reading ------------------------------------------------------------------------------


def hold_rings(conn: Connection, storage: QueueStorage) -> Connection:
    """Take ``ACCESS SHARE`` on every table ``storage``'s upkeep truncates (the rings and
    the terminal live counts) in ``conn``'s transaction, until it ends; returns ``conn``.

    Call it first in a ``REPEATABLE READ`` transaction whose reads of the install must all
    agree: its snapshot, taken by the next statement, then sees every ring as it stays
    until the transaction ends, since no prune, counter rollup or rebuild can truncate a
    held table meanwhile (prune and rollup report ``Blocked``; the rebuild waits).
    Enqueues, claims and completions are not held up. Called after the transaction's first
    query it cannot bring back what a truncation already took from that snapshot."""
    return hold(conn, truncated_by_upkeep(storage.tables))


@translate_errors
def _read(target: Target, storage: QueueStorage, body: Callable[[Connection], R]) -> R:
    """``body`` under the ``SNAPSHOT`` policy (one REPEATABLE READ read-only transaction of
    its own on an Engine, the caller's transaction otherwise), after :func:`hold_rings`."""
    return run(Policy.SNAPSHOT, target, lambda conn: body(hold_rings(conn, storage)))


@dataclass(frozen=True)
class _Statements:
    heads: Select[Any]
    meta: Select[Any]
    deferred: Select[Any]
    dlq: Select[Any]
    done: CompoundSelect
    waiting_external: Select[Any]
    trusted: Select[Any]
    handed_back: Select[Any]


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> _Statements:
    h, m, q = sch.claim_heads, sch.queue_meta, sch.dlq
    df = live_deferred(sch)
    d, db, le = sch.done.parent, sch.done_batches.parent, sch.leases.parent
    n = func.count().label("n")
    return _Statements(
        heads=select(h.c.logical_queue, n).group_by(h.c.logical_queue),
        meta=select(m.c.queue, m.c.paused),
        deferred=select(df.c.queue, df.c.state, n).group_by(df.c.queue, df.c.state),
        dlq=select(q.c.queue, n).group_by(q.c.queue),
        # a batch done row counts each of its members, all completed (_by_queue sums the two)
        done=union_all(
            select(d.c.queue, d.c.state, n).group_by(d.c.queue, d.c.state),
            select(db.c.queue, cast(literal(JobState.COMPLETED.value), d.c.state.type).label("state"),
                   batch_member_total(db).label("n")).group_by(db.c.queue)),
        waiting_external=select(le.c.queue, n).where(le.c.state == JobState.WAITING_EXTERNAL).group_by(le.c.queue),
        trusted=select(sch.counter_state.c.terminal_counter_trusted_at.isnot(None)),
        handed_back=_handed_back_statement(df),
    )


def _handed_back_statement(df: Any) -> Select[Any]:
    def mark(key: str) -> Any:
        return func.jsonb_extract_path_text(df.c.payload, "progress", UNHANDLED_KEY, key)

    count = case((mark("count").regexp_match("^[0-9]{1,9}$"), func.cast(mark("count"), Integer)))
    return (select(df.c.queue, df.c.kind, func.count().label("n"), func.max(count).label("most"),
                    func.max(mark("at")).label("last_at"))
            .where(df.c.state == JobState.SCHEDULED, mark("run_lease") == func.cast(df.c.run_lease, Text))
            .group_by(df.c.queue, df.c.kind))


def _by_queue(rows: Iterable[Any], *, state: bool = False) -> dict[Any, int]:
    """Sum ``n`` of grouped rows by logical queue (and state when ``state``)."""
    out: dict[Any, int] = defaultdict(int)
    for r in rows:
        key = (logical_queue(r.queue), str(getattr(r.state, "value", r.state))) if state else logical_queue(r.queue)
        out[key] += int(r.n)
    return out


@dataclass(frozen=True)
class _Grouped:
    """The grouped reads behind :func:`queue_status`, by logical queue."""

    lanes: dict[str, int]
    paused: dict[str, bool]
    deferred: dict[Any, int]
    dlq: dict[Any, int]
    parked: dict[Any, int]
    done: dict[Any, int]

    @classmethod
    def read(cls, conn: Connection, sch: StorageSchema, *, done: bool) -> _Grouped:
        s = _statements(sch)
        return cls(lanes={r.logical_queue: int(r.n) for r in conn.execute(s.heads)},
                   paused={r.queue: bool(r.paused) for r in conn.execute(s.meta)},
                   deferred=_by_queue(conn.execute(s.deferred), state=True),
                   dlq=_by_queue(conn.execute(s.dlq)),
                   parked=_by_queue(conn.execute(s.waiting_external)),
                   done=_by_queue(conn.execute(s.done), state=True) if done else {})

    def names(self) -> list[str]:
        return sorted(set(self.lanes) | set(self.paused) | set(self.dlq) | set(self.parked)
                      | {k[0] for k in self.deferred} | {k[0] for k in self.done})


def queue_names(target: Target, storage: QueueStorage) -> list[str]:
    """Every logical queue of the install, sorted: those with a lane or options, and those
    with a deferred, retained terminal, parked or DLQ row."""
    return _read(target, storage, lambda conn: _Grouped.read(conn, storage.tables, done=True).names())


def queue_status(target: Target, storage: QueueStorage, queues: Sequence[str] | None = None,
                 *, exact: bool = True) -> list[QueueStatus]:
    """One :class:`QueueStatus` per logical queue (``queues``, or every queue of the
    install: :func:`queue_names`, less queues known only by retained terminal rows when not
    ``exact``), sorted by name."""
    return _read(target, storage, lambda conn: _queue_status(conn, storage, queues, exact))


def _queue_status(conn: Connection, storage: QueueStorage, queues: Sequence[str] | None,
                  exact: bool) -> list[QueueStatus]:
    g = _Grouped.read(conn, storage.tables, done=exact)
    counts = storage.queue_counts if exact else storage.queue_counts_fast
    out = []
    for name in g.names() if queues is None else sorted(set(queues)):
        c = counts(conn, name)
        kept = {st: g.done.get((name, st), 0) if exact else None
                for st in (JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED)}
        out.append(QueueStatus(
            queue=name, available=c.available, running=c.running,
            waiting_external=g.parked.get(name, 0), scheduled=g.deferred.get((name, JobState.SCHEDULED), 0),
            retryable=g.deferred.get((name, JobState.RETRYABLE), 0), terminal=c.terminal,
            completed=kept[JobState.COMPLETED], cancelled=kept[JobState.CANCELLED], failed=kept[JobState.FAILED],
            dlq=g.dlq.get(name, 0), paused=g.paused.get(name, False), lanes=g.lanes.get(name, 0)))
    return out


def handed_back_kinds(target: Target, storage: QueueStorage) -> list[HandedBack]:
    """Per logical queue and kind, the scheduled jobs whose last attempt a worker gave back
    because it had no task for their kind (see the module docstring), sorted by queue and
    kind. Jobs of that sort made available again and not yet claimed are not counted (a
    worker on the queue claims them within its poll interval)."""
    return _read(target, storage, lambda conn: _handed_back(conn, storage))


def _handed_back(conn: Connection, storage: QueueStorage) -> list[HandedBack]:
    grouped: dict[tuple[str, str], list[Any]] = {}
    for r in conn.execute(_statements(storage.tables).handed_back):
        key = (logical_queue(r.queue), r.kind)
        most = int(r.most or 0)
        prev = grouped.get(key)
        if prev is None:
            grouped[key] = [int(r.n), most, r.last_at or ""]
        else:
            prev[0] += int(r.n)
            prev[1] = max(prev[1], most)
            prev[2] = max(prev[2], r.last_at or "")
    return [HandedBack(q, k, n, most, at) for (q, k), (n, most, at) in sorted(grouped.items())]


@functools.lru_cache(maxsize=192)
def _ring_statements(ring: Ring) -> tuple[Select[Any], Select[Any]]:
    st = ring.state
    cursor = select(st.c.current_slot, st.c.generation, st.c.slot_count)

    def summed(size: Any, k: int) -> Any:
        return sum((size(regclass(child)) for child in ring.children(k)), literal(0))

    sizes = select(*(summed(func.pg_relation_size, k) for k in range(ring.slot_count)),
                   *(summed(func.pg_total_relation_size, k) for k in range(ring.slot_count)))
    return cursor, sizes


def ring_status(target: Target, storage: QueueStorage) -> tuple[RingStatus, ...]:
    """The queue, lease and claim rings' cursors and slots, in that order."""
    return _read(target, storage, lambda conn: _ring_status(conn, storage))


def _ring_status(conn: Connection, storage: QueueStorage) -> tuple[RingStatus, ...]:
    out = []
    for ring in storage.tables.rings:
        cursor_stmt, sizes_stmt = _ring_statements(ring)
        cur = conn.execute(cursor_stmt).one()
        sizes = conn.execute(sizes_stmt).one()
        slots = []
        for k in range(cur.slot_count):
            gen = slot_generation(cur.generation, k, cur.slot_count)
            slots.append(SlotStatus(slot=k, generation=gen if gen >= 0 else None,
                                    current=k == cur.current_slot, heap_bytes=int(sizes[k]),
                                    bytes=int(sizes[cur.slot_count + k])))
        out.append(RingStatus(name=ring.name, current_slot=int(cur.current_slot),
                              generation=int(cur.generation), slot_count=int(cur.slot_count),
                              slots=tuple(slots)))
    return tuple(out)


def _tables(family: Any) -> list[Table]:
    """A ring family's parent and children, or an unpartitioned table itself."""
    return [family.parent, *family.children] if hasattr(family, "children") else [family]


@functools.lru_cache(maxsize=64)
def family_of_tables(sch: StorageSchema) -> dict[str, str]:
    """Relation name → family (:data:`FAMILIES`) of every table the install declares;
    a table of the schema missing here (e.g. the version table) is ``other``."""
    receipts = sch.config.lease_claim_receipts
    members: dict[str, Sequence[Any]] = {
        "queue_ready": (sch.ready, sch.tombstones, sch.claim_ranges),
        "queue_done": (sch.done, sch.deltas, sch.done_batches),
        # heartbeat and progress rows live in the ring that holds the attempts
        "lease_ring": (sch.leases,) if receipts else (sch.leases, sch.progress),
        "claim_ring": ((sch.claims, sch.closures, sch.closure_batches, sch.progress) if receipts
                       else (sch.claims, sch.closures, sch.closure_batches)),
        "hot": (sch.lanes, sch.enqueue_heads, sch.claim_heads, sch.attempt_state,
                sch.claimer_leases, sch.claimer_state),
        "counters": (sch.live_counts, sch.rollups, sch.rollup_ledger, sch.counter_state),
        "deferred_wheel": (sch.wheel, sch.wheel_marks),
        "backlog": (sch.deferred, sch.dlq, sch.unique_claims, sch.unique_releases),
    }
    return {t.name: family for family, items in members.items() for item in items for t in _tables(item)}


_pg_class = table("pg_class", column("oid"), column("relname"), column("relnamespace"), column("relkind"),
                  schema="pg_catalog")
_pg_namespace = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")
_pg_stat = table("pg_stat_user_tables", column("relid"), column("n_live_tup"), column("n_dead_tup"),
                 schema="pg_catalog")
_HEALTH = (
    select(_pg_class.c.relname,
           func.coalesce(_pg_stat.c.n_live_tup, 0).label("live"),
           func.coalesce(_pg_stat.c.n_dead_tup, 0).label("dead"),
           func.pg_total_relation_size(_pg_class.c.oid).label("bytes"))
    .select_from(_pg_class.join(_pg_namespace, _pg_namespace.c.oid == _pg_class.c.relnamespace)
                 .outerjoin(_pg_stat, _pg_stat.c.relid == _pg_class.c.oid))
    .where(_pg_namespace.c.nspname == bindparam("schema_name", type_=Text()), _pg_class.c.relkind == "r")
    .order_by(_pg_class.c.relname)
)
_FRESH_STATS = select(func.pg_stat_clear_snapshot())


def schema_health(target: Target, storage: QueueStorage) -> SchemaHealth:
    """Live tuples, dead tuples and bytes of every table of the install's schema (plain
    tables and ring children; partitioned parents hold nothing themselves), per table and
    per family. Statistics are read afresh (``pg_stat_clear_snapshot``) even inside a
    transaction that read them before."""
    return _read(target, storage, lambda conn: _schema_health(conn, storage))


def _schema_health(conn: Connection, storage: QueueStorage) -> SchemaHealth:
    sch = storage.tables
    families = family_of_tables(sch)
    conn.execute(_FRESH_STATS)
    tables = tuple(
        TableHealth(name=r.relname, family=families.get(r.relname, "other"), live_tuples=int(r.live),
                    dead_tuples=int(r.dead), bytes=int(r.bytes))
        for r in conn.execute(_HEALTH, {"schema_name": sch.config.schema}))
    sums = []
    for name in FAMILIES:
        mine = [t for t in tables if t.family == name]
        sums.append(FamilyHealth(name=name, tables=len(mine),
                                 live_tuples=sum(t.live_tuples for t in mine),
                                 dead_tuples=sum(t.dead_tuples for t in mine),
                                 bytes=sum(t.bytes for t in mine)))
    return SchemaHealth(schema=sch.config.schema, families=tuple(sums), tables=tables)


def status_report(target: Target, storage: QueueStorage, *, exact: bool = True) -> StatusReport:
    """Queues (exact counts, or the fast ones when ``exact`` is False), rings and health of
    the install, read in one transaction (one snapshot on an Engine)."""
    cfg = storage.config

    def body(conn: Connection) -> StatusReport:
        trusted = bool(conn.execute(_statements(storage.tables).trusted).scalar())
        return StatusReport(
            schema=cfg.schema, exact=exact, counters_trusted=trusted,
            shape={"queue_slot_count": cfg.queue_slot_count, "lease_slot_count": cfg.lease_slot_count,
                   "claim_slot_count": cfg.claim_slot_count, "queue_stripe_count": cfg.queue_stripe_count,
                   "lease_claim_receipts": cfg.lease_claim_receipts},
            queues=tuple(_queue_status(conn, storage, None, exact)),
            rings=_ring_status(conn, storage),
            health=_schema_health(conn, storage),
            handed_back=tuple(_handed_back(conn, storage)))

    return _read(target, storage, body)
