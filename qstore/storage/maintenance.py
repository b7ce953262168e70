"""Ring maintenance: rotate and prune the queue, lease and claim rings.

Every function takes a target first (``Engine``: own transaction, committed; ``Connection``
/ ``Session``: the caller's transaction, never committed here — see
:mod:`qstore.storage._tx`) and the install's :class:`~qstore.schema.StorageSchema`.

Guarantees
----------
* **Nothing upkeep does leaves a dead tuple per tick.** A ring's cursor is a sequence
  holding its generation (current slot = ``generation % slot_count``): rotation is a
  ``setval``; a slot's generation follows from the ring's; a pruned slot is recognised by
  its empty children. Rotate, prune and the counter rollup of one ring serialise on a
  transaction-scoped advisory lock of that ring, not on a row.
* **Rotate** (all rings) moves the ring only into a slot whose children hold no live row
  (else ``SkippedBusy`` with the counts found), and not at all when nothing was written to
  the current slot since it was (re)initialised (``SkippedIdle``). "Nothing written" is
  judged by the physical size of the current slot's children (``pg_relation_size = 0``),
  so a lease slot whose rows were all deleted still counts as written and rotates away,
  letting prune reclaim its dead tuples by ``TRUNCATE``.
* **Prune** takes the ring lock, runs the cheap gates *without* the exclusive lock (a busy
  slot never queues an ``ACCESS EXCLUSIVE`` request in front of hot readers), then
  ``lock_timeout = 50ms`` + ``LOCK … IN ACCESS EXCLUSIVE MODE`` on every child of the slot,
  re-checks what could have changed while the lock was awaited, and truncates all children
  in one ``TRUNCATE``. The locked section runs in a SAVEPOINT: a lock timeout (SQLSTATE
  55P03, or a deadlock 40P01) rolls the savepoint back and is reported as
  ``PruneOutcome(kind="blocked")`` — never raised — and the caller's transaction stays
  usable. The 50 ms timeout is restored before the savepoint is released, so it never
  leaks into a caller's transaction.
* **Queue-ring gates** count every physical row of the slot regardless of its generation
  (a late writer's row is legal anywhere) and use the committed claim-range chain as the
  claim truth:

  - G1 ``QUEUE_ACTIVE_LEASES``: leases (any lease slot) with ``ready_slot = k``;
  - G2 ``QUEUE_PENDING_READY``: ready rows of slot k neither tombstoned nor covered by a
    ``ready_claim_ranges`` row of their lane;
  - G3 ``QUEUE_OPEN_CLAIMS``: claims (any claim slot) with ``ready_slot = k`` and no closure.

  A slot whose jobs were claimed and then completed, retried, rescued, cancelled or moved to
  the DLQ therefore becomes prunable as soon as no attempt references it. Once the gates
  pass, only a new ready row can make them fail again (a row found spent stays spent), so
  under the exclusive lock the gates are re-run only if the slot's ready-row count moved:
  the lock is held for a count, the fold and the ``TRUNCATE``.
* **Queue-ring prune** folds ground truth before destroying it: ``count(done_k)`` by
  ``(queue, priority)`` is appended to ``queue_terminal_rollup_ledger`` (no row updated)
  and the slot's ``queue_terminal_live_counts`` rows are deleted in the same transaction as
  the ``TRUNCATE`` (the slot's unrolled deltas go with it), so exact ``terminal`` counts
  survive pruning.
* **Unique keys**: unique claims owned by the jobs whose done rows are truncated are
  released in the same transaction (only when that job still owns the key). *Window*: a
  job whose ``unique_states`` keeps its key while completed/failed/cancelled owns it only as
  long as its terminal history is retained — roughly ``queue_slot_count`` rotations after
  the slot it was enqueued in was sealed. After that, an enqueue with the same key succeeds.
* **Late writers**: a writer that read the queue-ring cursor before a rotation can still
  insert into a slot that was sealed — even one that was just pruned (the COPY enqueue path
  reads the cursor one statement early). Such a row keeps the slot non-empty, so rotation
  into it reports ``SkippedBusy``, prune targets it again (it is no longer empty), and the
  generation-agnostic gates keep the late row alive until it is spent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Select,
    Table,
    and_,
    bindparam,
    cast,
    delete,
    false,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy import Sequence as SaSequence
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import REGCLASS

from qstore.errors import ValidationError, translate_errors
from qstore.model import (
    BusyCounts,
    PruneOutcome,
    RotateOutcome,
    SkipReason,
    TerminalDeltaRollupOutcome,
)
from qstore.schema import Ring, StorageSchema
from qstore.storage._tx import Target, transaction
from qstore.storage.statements import receipt_closed

__all__ = [
    "BLOCKED",
    "BUSY_COUNT_CAP",
    "LOCK_TIMEOUT",
    "MaintenanceOps",
    "guarded",
    "is_lock_failure",
    "lock_exclusive",
    "prune_oldest",
    "prune_oldest_claims",
    "prune_oldest_leases",
    "rotate",
    "rotate_claims",
    "rotate_leases",
    "truncate_tables",
    "vacuum_leases",
]

#: ``lock_timeout`` for every ``ACCESS EXCLUSIVE`` request of prune and delta rollup.
LOCK_TIMEOUT = "50ms"
#: Row counts reported in ``BusyCounts`` / ``SkippedActive.count`` saturate here, so a
#: maintenance tick over a huge backlog stays cheap. Any non-zero count blocks all the same.
BUSY_COUNT_CAP = 10_000
_LOCK_FAILURES = frozenset({"55P03", "40P01"})  # lock_not_available, deadlock_detected

_BUSY_FIELD = {
    "ready_entries": "queue_ready",
    "ready_tombstones": "queue_tombstones",
    "ready_claim_ranges": "queue_claim_ranges",
    "done_entries": "queue_done",
    "queue_terminal_count_deltas": "queue_terminal_deltas",
    "leases": "leases",
    "lease_claims": "claims",
    "lease_claim_closures": "closures",
}
_PG = postgresql.dialect()

T = TypeVar("T")


# -- shared locking helpers (also used by qstore.storage.counters) -------------------------
class _Blocked:
    """Sentinel: a lock request of a guarded section timed out."""

    def __repr__(self) -> str:
        return "BLOCKED"


BLOCKED = _Blocked()


def is_lock_failure(err: BaseException) -> bool:
    """True for a driver error meaning "could not get the lock in time" (55P03 / 40P01)."""
    if not isinstance(err, sa_exc.DBAPIError):
        return False
    orig = err.orig
    return (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) in _LOCK_FAILURES


def guarded(conn: Connection, body: Callable[[], T]) -> T | _Blocked:
    """Run ``body`` in a SAVEPOINT with ``lock_timeout = 50ms``.

    Returns ``body()``'s result, or :data:`BLOCKED` when a lock wait inside it timed out (the
    savepoint is rolled back: nothing ``body`` wrote survives, the outer transaction stays
    usable). Any other error rolls the savepoint back and propagates. On success the
    previous ``lock_timeout`` is restored before the savepoint is released.
    """
    previous = conn.execute(select(func.current_setting("lock_timeout"))).scalar_one()
    savepoint = conn.begin_nested()
    try:
        conn.execute(select(func.set_config("lock_timeout", LOCK_TIMEOUT, True)))
        result = body()
        conn.execute(select(func.set_config("lock_timeout", previous, True)))
    except BaseException as err:
        if savepoint.is_active:
            savepoint.rollback()
        if is_lock_failure(err):
            return BLOCKED
        raise
    savepoint.commit()
    return result


def _qualified(conn: Connection, tables: Sequence[Table]) -> str:
    prep = conn.dialect.identifier_preparer
    return ", ".join(prep.format_table(t) for t in tables)


def lock_exclusive(conn: Connection, tables: Sequence[Table]) -> None:
    """``LOCK TABLE … IN ACCESS EXCLUSIVE MODE`` (identifiers quoted by the dialect)."""
    conn.execute(text(f"LOCK TABLE {_qualified(conn, tables)} IN ACCESS EXCLUSIVE MODE"))


def truncate_tables(conn: Connection, tables: Sequence[Table]) -> None:
    """One ``TRUNCATE`` statement for all ``tables``."""
    conn.execute(text(f"TRUNCATE {_qualified(conn, tables)}"))


def _regclass(t: Table | SaSequence) -> Any:
    prep = _PG.identifier_preparer
    assert t.schema is not None, t  # every storage table is schema-qualified
    return cast(literal(f"{prep.quote_schema(t.schema)}.{prep.quote(t.name)}"), REGCLASS)


def _bounded_count(rows: Select[Any], cap: int = BUSY_COUNT_CAP) -> Select[Any]:
    return select(func.count()).select_from(rows.limit(cap).subquery())


# -- statements ------------------------------------------------------------------------------
_RINGS = {"queue": 0, "lease": 1, "claim": 2}


def ring_of(sch: StorageSchema, name: str) -> Ring:
    return sch.rings[_RINGS[name]]


def lock_ring(conn: Connection, sch: StorageSchema, ring: Ring) -> None:
    """Serialise rotate, prune and counter rollup of one ring: a transaction-scoped
    advisory lock (no row is locked or updated, so holding it leaves nothing behind)."""
    key = f"qstore.ring:{sch.config.schema}:{ring.name}"
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(key, 0))))


@functools.lru_cache(maxsize=64)
def _cursor_statements(sch: StorageSchema, ring_name: str) -> dict[str, Any]:
    ring = ring_of(sch, ring_name)
    return {
        "generation": select(ring.state.c.generation),
        "advance": select(func.setval(_regclass(ring.generation), bindparam("gen", type_=BigInteger()),
                                      True)),
    }


def generation(conn: Connection, sch: StorageSchema, ring: Ring) -> int:
    """The ring's current generation (its current slot is ``generation % slot_count``)."""
    return int(conn.execute(_cursor_statements(sch, ring.name)["generation"]).scalar_one())


def slot_generation(gen: int, slot: int, slot_count: int) -> int:
    """The generation ``slot`` last had when the ring is at ``gen`` (negative: never
    initialised). Rotation moves one slot and one generation at a time from (0, 0), so
    slot k was last current at the greatest generation <= ``gen`` congruent to k."""
    return gen - (gen - slot) % slot_count


@functools.lru_cache(maxsize=4096)
def _slot_probe(sch: StorageSchema, ring_name: str, slot: int) -> dict[str, Any]:
    """Per-(ring, slot) emptiness probes: physical sizes and bounded live-row counts."""
    ring = ring_of(sch, ring_name)
    kids = ring.children(slot)
    return {
        "sizes": select(*(func.pg_relation_size(_regclass(c)) for c in kids)),
        "counts": select(*(
            _bounded_count(select(literal(1)).select_from(c)).scalar_subquery().label(f.name)
            for f, c in zip(ring.families, kids, strict=True)
        )),
    }


@functools.lru_cache(maxsize=4096)
def _queue_gates(sch: StorageSchema, k: int) -> dict[str, Any]:
    """Gates G1-G3 and the fold/release statements of queue slot ``k``."""
    r, t, crk, d, _dl = sch.queue_ring.children(k)
    crp = sch.claim_ranges.parent
    le, c, cl = sch.leases.parent, sch.claims.parent, sch.closures.parent
    u, ledger, live = sch.unique_claims, sch.rollup_ledger, sch.live_counts

    def same_lane(x: Any) -> Any:
        return and_(x.c.queue == r.c.queue, x.c.priority == r.c.priority,
                    x.c.enqueue_shard == r.c.enqueue_shard)

    def covered(cr: Any) -> Any:
        # Ranges of a lane are disjoint (a claim consumes positions once), so the covering
        # range, if any, is the one with the greatest first_seq <= lane_seq: one index probe.
        # Were ranges ever to overlap this could only report a spent row as pending (safe).
        last = (select(cr.c.last_seq).where(same_lane(cr), cr.c.first_seq <= r.c.lane_seq)
                .order_by(cr.c.first_seq.desc()).limit(1).scalar_subquery())
        return func.coalesce(last >= r.c.lane_seq, false())

    tombstoned = select(t.c.lane_seq).where(same_lane(t), t.c.lane_seq == r.c.lane_seq).exists()
    closed = receipt_closed(cl, c)
    # The slot's own range child first (where ranges live); the parent only for rows it
    # does not cover, so the common case costs one probe per row.
    pending = select(literal(1)).select_from(r).where(~tombstoned, ~covered(crk), ~covered(crp))

    # Ground truth of the slot's terminal history, appended to the ledger (no row updated).
    count = func.count()
    fold = insert(ledger).from_select(
        ["queue", "priority", "pruned_count"],
        select(d.c.queue, d.c.priority, count).group_by(d.c.queue, d.c.priority)
        .having(count > 0).order_by(d.c.queue, d.c.priority),
    )
    key = func.coalesce(d.c.unique_key, r.c.unique_key)
    owners = (
        select(key.label("unique_key"), d.c.job_id)
        .select_from(d.outerjoin(r, and_(
            r.c.ready_slot == d.c.ready_slot, r.c.queue == d.c.queue, r.c.priority == d.c.priority,
            r.c.enqueue_shard == d.c.enqueue_shard, r.c.lane_seq == d.c.lane_seq)))
        .where(key.isnot(None))
        .subquery("owners")
    )
    return {
        "active_leases": _bounded_count(select(literal(1)).select_from(le).where(le.c.ready_slot == k)),
        "pending_ready": _bounded_count(pending),
        "open_claims": _bounded_count(select(literal(1)).select_from(c).where(c.c.ready_slot == k, ~closed)),
        "ready_rows": select(func.count()).select_from(r),
        "fold": fold,
        "release_unique": delete(u).where(u.c.unique_key == owners.c.unique_key,
                                          u.c.job_id == owners.c.job_id),
        "drop_live": delete(live).where(live.c.ready_slot == k),
    }


@functools.lru_cache(maxsize=4096)
def _derived_gate(sch: StorageSchema, ring_name: str, k: int) -> Select[Any]:
    """Lease ring: live leases in slot ``k``; claim ring: claims of slot ``k`` without a
    closure in the same slot."""
    if ring_name == "lease":
        return _bounded_count(select(literal(1)).select_from(sch.leases.children[k]))
    c, cl = sch.claims.children[k], sch.closures.children[k]
    closed = receipt_closed(cl, c)
    return _bounded_count(select(literal(1)).select_from(c).where(~closed))


def _pristine(conn: Connection, sch: StorageSchema, ring: Ring, slot: int) -> bool:
    """True when nothing was ever written to ``slot``'s children since they were created or
    last truncated (every heap is zero bytes; rolled-back writes count as written)."""
    return not any(conn.execute(_slot_probe(sch, ring.name, slot)["sizes"]).one())


def _busy(conn: Connection, sch: StorageSchema, ring: Ring, slot: int) -> BusyCounts:
    row = conn.execute(_slot_probe(sch, ring.name, slot)["counts"]).one()._mapping
    return BusyCounts(**{_BUSY_FIELD[name]: int(n) for name, n in row.items()})


# -- rotate ----------------------------------------------------------------------------------
def _rotate(target: Target, sch: StorageSchema, ring: Ring) -> RotateOutcome:
    n = ring.slot_count
    with transaction(target) as conn:
        lock_ring(conn, sch, ring)
        gen = generation(conn, sch, ring)
        cur = gen % n
        if _pristine(conn, sch, ring, cur):
            return RotateOutcome.skipped_idle(cur, gen)
        nxt = (cur + 1) % n
        busy = _busy(conn, sch, ring, nxt)
        if busy.total():
            return RotateOutcome.skipped_busy(nxt, busy)
        # A sequence move: no row is updated, so a rotation leaves no dead tuple. It is not
        # undone by a rollback of the surrounding transaction, which is harmless: the
        # incoming slot was just found empty under the ring lock.
        conn.execute(_cursor_statements(sch, ring.name)["advance"], {"gen": gen + 1})
        return RotateOutcome.rotated(nxt, gen + 1)


def rotate(target: Target, sch: StorageSchema) -> RotateOutcome:
    """Queue ring: move to ``(current+1) % N`` with ``generation+1`` if every child of the
    incoming slot (ready, tombstones, claim ranges, done, deltas) is empty. ``SkippedBusy``
    (with counts, saturating at :data:`BUSY_COUNT_CAP`) otherwise; ``SkippedIdle`` when the
    current slot was never written."""
    return _rotate(target, sch, sch.queue_ring)


def rotate_leases(target: Target, sch: StorageSchema) -> RotateOutcome:
    """Lease ring rotation; the incoming lease child must hold no live lease (dead tuples
    are fine)."""
    return _rotate(target, sch, sch.lease_ring)


def rotate_claims(target: Target, sch: StorageSchema) -> RotateOutcome:
    """Claim ring rotation; incoming claim and closure children empty."""
    return _rotate(target, sch, sch.claim_ring)


# -- prune: queue ring -----------------------------------------------------------------------
def _queue_gate_failure(conn: Connection, st: dict[str, Any], k: int) -> PruneOutcome | None:
    for name, reason in (("active_leases", SkipReason.QUEUE_ACTIVE_LEASES),
                         ("pending_ready", SkipReason.QUEUE_PENDING_READY),
                         ("open_claims", SkipReason.QUEUE_OPEN_CLAIMS)):
        n = int(conn.execute(st[name]).scalar_one())
        if n:
            return PruneOutcome.skipped_active(k, reason, n)
    return None


def _prune_queue_slot(conn: Connection, sch: StorageSchema, k: int) -> PruneOutcome:
    st = _queue_gates(sch, k)
    early = _queue_gate_failure(conn, st, k)
    if early is not None:
        return early
    ready_rows = int(conn.execute(st["ready_rows"]).scalar_one())
    lock_exclusive(conn, sch.queue_ring.children(k))
    # Under the lock, every row committed while it was awaited is visible. Once the gates
    # pass they can only fail again through a ready row that arrived since (a late writer
    # that read the ring cursor before a rotation): ready rows are never deleted, so an
    # unchanged count proves the early gates still hold and keeps the lock short.
    if int(conn.execute(st["ready_rows"]).scalar_one()) != ready_rows:
        late = _queue_gate_failure(conn, st, k)
        if late is not None:
            return late
    conn.execute(st["fold"])
    conn.execute(st["release_unique"])
    conn.execute(st["drop_live"])
    truncate_tables(conn, sch.queue_ring.children(k))
    return PruneOutcome.pruned(k)


def prune_oldest(target: Target, sch: StorageSchema) -> PruneOutcome:
    """Prune the oldest sealed queue slot that holds anything (slots are taken oldest
    generation first; a slot already pruned and not written since is passed over).
    ``Noop`` when no sealed slot holds rows; ``SkippedActive`` with the first failing gate
    (G1 → G2 → G3) and its count; ``Blocked`` when the exclusive lock was not granted
    within 50 ms; else ``Pruned`` after appending the slot's terminal counts to the rollup
    ledger, releasing its jobs' unique keys and truncating its children."""
    ring = sch.queue_ring
    n = ring.slot_count
    with transaction(target) as conn:
        lock_ring(conn, sch, ring)
        gen = generation(conn, sch, ring)
        cur = gen % n
        k = next((slot for slot in ((cur + i) % n for i in range(1, n))
                  if not _pristine(conn, sch, ring, slot)), None)
        if k is None:
            return PruneOutcome.noop()
        result = guarded(conn, lambda: _prune_queue_slot(conn, sch, k))
        return PruneOutcome.blocked(k) if isinstance(result, _Blocked) else result


# -- prune: lease and claim rings ------------------------------------------------------------
_CURRENT = {"lease": SkipReason.LEASE_CURRENT, "claim": SkipReason.CLAIM_CURRENT}
_ACTIVE = {"lease": SkipReason.LEASE_ACTIVE, "claim": SkipReason.CLAIM_OPEN}


def oldest_initialised_slot(current: int, generation: int, slot_count: int) -> int | None:
    """The oldest initialised slot of a ring at ``(current, generation)``, or None when
    only the current slot was ever initialised."""
    initialised = min(generation + 1, slot_count)
    if slot_count <= 1 or initialised <= 1:
        return None
    return (current - (initialised - 1)) % slot_count


def _prune_derived_slot(conn: Connection, sch: StorageSchema, ring: Ring, k: int) -> PruneOutcome:
    gate = _derived_gate(sch, ring.name, k)
    n = int(conn.execute(gate).scalar_one())
    if n:
        return PruneOutcome.skipped_active(k, _ACTIVE[ring.name], n)
    if _pristine(conn, sch, ring, k):
        return PruneOutcome.noop()  # already truncated, nothing written since
    lock_exclusive(conn, ring.children(k))
    n = int(conn.execute(gate).scalar_one())
    if n:
        return PruneOutcome.skipped_active(k, _ACTIVE[ring.name], n)
    truncate_tables(conn, ring.children(k))
    return PruneOutcome.pruned(k)


def _prune_derived(target: Target, sch: StorageSchema, ring: Ring) -> PruneOutcome:
    n = ring.slot_count
    with transaction(target) as conn:
        lock_ring(conn, sch, ring)
        gen = generation(conn, sch, ring)
        cur = gen % n
        k = oldest_initialised_slot(cur, gen, n)
        if k is None:
            # Only the current slot was ever initialised: nothing to do if it is pristine,
            # otherwise its rows/dead tuples can only be reclaimed after a rotation.
            if _pristine(conn, sch, ring, cur):
                return PruneOutcome.noop()
            return PruneOutcome.skipped_active(cur, _CURRENT[ring.name], 0)
        result = guarded(conn, lambda: _prune_derived_slot(conn, sch, ring, k))
        return PruneOutcome.blocked(k) if isinstance(result, _Blocked) else result


def prune_oldest_leases(target: Target, sch: StorageSchema) -> PruneOutcome:
    """Truncate the oldest initialised lease slot if it is not current (``LEASE_CURRENT``)
    and holds no lease (``LEASE_ACTIVE``, count). ``Noop`` when nothing needs reclaiming
    (never rotated and pristine, or the oldest slot is already truncated); ``Blocked`` on a
    lock timeout."""
    return _prune_derived(target, sch, sch.lease_ring)


def prune_oldest_claims(target: Target, sch: StorageSchema) -> PruneOutcome:
    """Truncate the oldest initialised claim slot (claims + closures, one statement) if it
    is not current (``CLAIM_CURRENT``) and every claim in it has a closure in the same slot
    (``CLAIM_OPEN``, count of open claims)."""
    return _prune_derived(target, sch, sch.claim_ring)


# -- vacuum ----------------------------------------------------------------------------------
def vacuum_leases(target: Target, sch: StorageSchema) -> None:
    """``VACUUM <schema>.leases`` (all lease partitions) on an autocommit connection.

    Fallback for a pinned lease ring (e.g. a long ``waiting_external`` lease keeps rotation
    from reaching its slot, so deleted leases accumulate). ``VACUUM`` cannot run inside a
    transaction block, so the target must be an ``Engine``; a Connection or Session raises
    :class:`~qstore.errors.ValidationError` and nothing runs.
    """
    if not isinstance(target, Engine):
        raise ValidationError(
            "target", type(target).__name__,
            "VACUUM cannot run inside a transaction block: pass an Engine",
        )
    with target.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text(f"VACUUM {_qualified(conn, [sch.leases.parent])}"))


# -- facade mixin ----------------------------------------------------------------------------
class MaintenanceOps:
    """Maintenance methods of :class:`~qstore.storage.QueueStorage` (seed names).

    Expects ``self._schema`` (the install's :class:`~qstore.schema.StorageSchema`).
    """

    _schema: StorageSchema

    @translate_errors
    def rotate(self, target: Target) -> RotateOutcome:
        """Queue-ring rotation; see :func:`qstore.storage.maintenance.rotate`."""
        return rotate(target, self._schema)

    @translate_errors
    def prune_oldest(self, target: Target) -> PruneOutcome:
        """Queue-ring prune; see :func:`qstore.storage.maintenance.prune_oldest`."""
        return prune_oldest(target, self._schema)

    @translate_errors
    def rotate_leases(self, target: Target) -> RotateOutcome:
        return rotate_leases(target, self._schema)

    @translate_errors
    def prune_oldest_leases(self, target: Target) -> PruneOutcome:
        return prune_oldest_leases(target, self._schema)

    @translate_errors
    def vacuum_leases(self, target: Target) -> None:
        vacuum_leases(target, self._schema)

    @translate_errors
    def rotate_claims(self, target: Target) -> RotateOutcome:
        return rotate_claims(target, self._schema)

    @translate_errors
    def prune_oldest_claims(self, target: Target) -> PruneOutcome:
        return prune_oldest_claims(target, self._schema)

    @translate_errors
    def rollup_terminal_count_deltas(self, target: Target, max_slots: int, *,
                                     pinned_after: timedelta | None = None) -> TerminalDeltaRollupOutcome:
        """Fold pending deltas of up to ``max_slots`` sealed, inactive slots into the live
        counters (standing down while a snapshot older than ``pinned_after``, default 5 s,
        pins the horizon); see :func:`qstore.storage.counters.rollup_terminal_count_deltas`."""
        from qstore.storage import counters

        return counters.rollup_terminal_count_deltas(
            target, self._schema, max_slots,
            pinned_after=counters.PINNED_AFTER if pinned_after is None else pinned_after)

    @translate_errors
    def rebuild_terminal_counters(self, target: Target) -> int:
        """Rebuild live counters from ``done_entries``; returns counter rows written."""
        from qstore.storage import counters

        return counters.rebuild_terminal_counters(target, self._schema)

    @translate_errors
    def terminal_counter_trusted(self, target: Target) -> bool:
        from qstore.storage import counters

        return counters.terminal_counter_trusted(target, self._schema)
