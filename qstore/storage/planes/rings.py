"""Upkeep of the rings as a whole: ring cursors, slot emptiness, exclusive locks and
``TRUNCATE``.

A ring's cursor is a sequence holding its generation; the current slot is
``generation % slot_count``. Rotating is a ``setval`` (no row is updated, so it leaves no
dead tuple) and a slot's generation follows from the ring's. Rotate, prune and the counter
rollup of one ring serialise on a transaction-scoped advisory lock of that ring.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Select,
    Table,
    bindparam,
    case,
    cast,
    func,
    literal,
    select,
    text,
)
from sqlalchemy import Sequence as SaSequence
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import REGCLASS

from qstore.schema import Ring, RingFamily, StorageSchema
from qstore.types import BusyCounts

__all__ = [
    "BUSY_COUNT_CAP",
    "advance",
    "bounded_count",
    "busy",
    "generation",
    "lock_exclusive",
    "lock_ring",
    "pristine",
    "pristine_slots",
    "slot_generation",
    "truncate_child",
    "truncate_family",
    "truncate_written",
]

#: Row counts reported in ``BusyCounts`` / ``SkippedActive.count`` saturate here, so a
#: maintenance tick over a huge backlog stays cheap. Any non-zero count blocks all the same.
BUSY_COUNT_CAP = 10_000
_BUSY_FIELD = {
    "ready_entries": "queue_ready",
    "ready_tombstones": "queue_tombstones",
    "ready_claim_ranges": "queue_claim_ranges",
    "done_entries": "queue_done",
    "queue_terminal_count_deltas": "queue_terminal_deltas",
    "done_batches": "queue_done_batches",
    "leases": "leases",
    "lease_claims": "claims",
    "lease_claim_closures": "closures",
    "lease_claim_closure_batches": "closure_batches",
    "attempt_progress": "progress",
}
_PG = postgresql.dialect()


def _qualified(conn: Connection, tables: Sequence[Table]) -> str:
    prep = conn.dialect.identifier_preparer
    return ", ".join(prep.format_table(t) for t in tables)


def lock_exclusive(conn: Connection, tables: Sequence[Table]) -> None:
    """``LOCK TABLE … IN ACCESS EXCLUSIVE MODE`` (identifiers quoted by the dialect)."""
    conn.execute(text(f"LOCK TABLE {_qualified(conn, tables)} IN ACCESS EXCLUSIVE MODE"))


def _truncate(conn: Connection, tables: Sequence[Table]) -> None:
    """One ``TRUNCATE`` statement for all ``tables`` (none: nothing is sent)."""
    if tables:
        conn.execute(text(f"TRUNCATE {_qualified(conn, tables)}"))


def truncate_family(conn: Connection, family: RingFamily) -> None:
    """``TRUNCATE`` every slot child of ``family`` (its partitioned parent)."""
    _truncate(conn, [family.parent])


def truncate_child(conn: Connection, family: RingFamily, slot: int) -> None:
    """``TRUNCATE`` ``family``'s child of ``slot``."""
    _truncate(conn, [family.children[slot]])


def vacuum(conn: Connection, tables: Sequence[Table]) -> None:
    """``VACUUM`` ``tables`` (``conn`` must be in autocommit: outside a transaction block)."""
    conn.execute(text(f"VACUUM {_qualified(conn, tables)}"))


def regclass(t: Table | SaSequence) -> Any:
    """``'<schema>.<name>'::regclass`` of a table or sequence (quoted by the dialect)."""
    prep = _PG.identifier_preparer
    assert t.schema is not None, t  # every storage table and sequence is schema-qualified
    return cast(literal(f"{prep.quote_schema(t.schema)}.{prep.quote(t.name)}"), REGCLASS)


def bounded_count(rows: Select[Any], cap: int = BUSY_COUNT_CAP) -> Select[Any]:
    """``count(*)`` of ``rows``, saturating at ``cap``."""
    return select(func.count()).select_from(rows.limit(cap).subquery())


def lock_ring(conn: Connection, sch: StorageSchema, ring: Ring) -> None:
    """Serialise rotate, prune and counter rollup of one ring: a transaction-scoped
    advisory lock (no row is locked or updated, so holding it leaves nothing behind)."""
    key = f"qstore.ring:{sch.config.schema}:{ring.name}"
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(key, 0))))


@dataclass(frozen=True)
class CursorStatements:
    generation: Select[Any]
    advance: Select[Any]


@functools.lru_cache(maxsize=192)
def _cursor(ring: Ring) -> CursorStatements:
    return CursorStatements(
        generation=select(ring.state.c.generation),
        advance=select(func.setval(regclass(ring.generation), bindparam("gen", type_=BigInteger()), True)),
    )


def generation(conn: Connection, ring: Ring) -> int:
    """The ring's current generation (its current slot is ``generation % slot_count``)."""
    return int(conn.execute(_cursor(ring).generation).scalar_one())


def advance(conn: Connection, ring: Ring, to: int) -> None:
    """Move the ring's cursor to generation ``to``. A sequence move: no row is updated, so
    it leaves no dead tuple; other sessions see it at once and a rollback of the
    surrounding transaction does not undo it (so rotations refuse a caller's transaction:
    the ``OWN`` policy)."""
    conn.execute(_cursor(ring).advance, {"gen": to})


def slot_generation(gen: int, slot: int, slot_count: int) -> int:
    """The generation ``slot`` last had when the ring is at ``gen`` (negative: never
    initialised). Rotation moves one slot and one generation at a time from (0, 0), so
    slot k was last current at the greatest generation <= ``gen`` congruent to k."""
    return gen - (gen - slot) % slot_count


@dataclass(frozen=True)
class SlotProbes:
    sizes: Select[Any]
    counts: Select[Any]


def _heap_sizes(tables: Sequence[Table]) -> Select[Any]:
    """One row: the heap size in bytes of each of ``tables``, in order."""
    return select(*(func.pg_relation_size(regclass(t)) for t in tables))


@functools.lru_cache(maxsize=4096)
def _slot_probes(ring: Ring, slot: int) -> SlotProbes:
    kids = ring.children(slot)
    return SlotProbes(
        sizes=_heap_sizes(kids),
        counts=select(*(
            bounded_count(select(literal(1)).select_from(c)).scalar_subquery().label(f.name)
            for f, c in zip(ring.families, kids, strict=True)
        )),
    )


def pristine(conn: Connection, ring: Ring, slot: int) -> bool:
    """True when nothing was ever written to ``slot``'s children since they were created or
    last truncated (every heap is zero bytes; rolled-back writes count as written)."""
    return not any(conn.execute(_slot_probes(ring, slot).sizes).one())


@functools.lru_cache(maxsize=256)
def _ring_sizes(ring: Ring) -> Select[Any]:
    return _heap_sizes([c for slot in range(ring.slot_count) for c in ring.children(slot)])


def pristine_slots(conn: Connection, ring: Ring) -> list[bool]:
    """:func:`pristine` of every slot of ``ring`` (indexed by slot), read in one statement
    instead of one per slot."""
    sizes = conn.execute(_ring_sizes(ring)).one()
    per_slot = len(ring.families)
    return [not any(sizes[i:i + per_slot]) for i in range(0, len(sizes), per_slot)]


@functools.lru_cache(maxsize=192)
def _current_bytes(ring: Ring) -> Select[Any]:
    cur = ring.state.c.generation % ring.slot_count
    per_slot = [
        (cur == k, sum((func.pg_relation_size(regclass(t)) for t in ring.children(k)), literal(0)))
        for k in range(ring.slot_count)
    ]
    return select(case(*per_slot, else_=literal(0))).select_from(ring.state)


def current_bytes(conn: Connection, ring: Ring) -> int:
    """Heap bytes of the children of ``ring``'s current slot, summed: how much has been
    written to the slot (deleted and rolled-back rows included) since it was (re)initialised.
    One statement, which opens the current slot's children only (a prune never truncates the
    current slot, so it does not queue behind one)."""
    return int(conn.execute(_current_bytes(ring)).scalar_one())


def truncate_written(conn: Connection, ring: Ring, slot: int) -> None:
    """``TRUNCATE``, in one statement, ``slot``'s children whose heap is not zero bytes: the
    ones it has anything to reclaim from. Truncating an unwritten child changes nothing but
    costs as much (new files, an index build and a file sync per index), so those are left
    alone. Call it under the children's exclusive lock, or a write may land after the sizes
    are read."""
    kids = ring.children(slot)
    sizes = conn.execute(_slot_probes(ring, slot).sizes).one()
    _truncate(conn, [t for t, size in zip(kids, sizes, strict=True) if size])


def busy(conn: Connection, ring: Ring, slot: int) -> BusyCounts:
    """Live rows in each of ``slot``'s children (saturating at :data:`BUSY_COUNT_CAP`)."""
    row = conn.execute(_slot_probes(ring, slot).counts).one()._mapping
    return BusyCounts(**{_BUSY_FIELD[name]: int(n) for name, n in row.items()})
