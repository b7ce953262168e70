"""Ring maintenance: rotate and prune the queue, lease and claim rings.

The operations run on a connection in the transaction their policy gives them: prune in
one of its own with an Engine, the caller's otherwise; rotation only ever in one of its own
(a ring's cursor is a sequence, which a rollback would not undo, so a caller's transaction
is refused).

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
  re-checks what could have changed while the lock was awaited, and truncates every child
  that was written (heap not zero bytes) in one ``TRUNCATE``: an unwritten child holds
  nothing, and truncating it would still create its files anew and sync each index build.
  The locked section is a guarded step (:func:`qstore.storage.targets.guarded`): a
  SAVEPOINT whose lock timeout (SQLSTATE 55P03, or a deadlock 40P01) rolls it back and is
  reported as ``PruneOutcome(kind="blocked")`` — never raised — and the caller's
  transaction stays usable. The 50 ms timeout is restored before the savepoint is
  released, so it never leaks into a caller's transaction.
* **Queue-ring gates** count every physical row of the slot regardless of its generation
  (a late writer's row is legal anywhere) and use the committed claim-range chain as the
  claim truth:

  - G1 ``QUEUE_ACTIVE_LEASES``: leases (any lease slot) with ``ready_slot = k``;
  - G2 ``QUEUE_PENDING_READY``: ready rows of slot k neither tombstoned nor covered by a
    ``ready_claim_ranges`` row of their lane. The lanes' claim cursors are read first: a
    claim moves its lane's cursor only over positions it found covered by committed claim
    ranges (or spent: aborted reservations, truncated history), so when no lane has a row
    in the slot beyond its cursor, nothing there is pending, at one index probe per lane.
    Otherwise the last ``TAIL_PROBE`` rows of every lane are
    probed first (claims consume a lane in position order, so a backlog shows there); the
    skip then reports the pending rows found among them, a lower bound. Only when none is
    pending is the whole slot counted, so a backlog of any size costs a few index probes;
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
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    and_,
    false,
    func,
    literal,
    select,
    true,
)

from qstore.schema import Ring, StorageSchema
from qstore.storage.context import StorageContext
from qstore.storage.planes import control
from qstore.storage.planes import rings as ring_plane
from qstore.storage.planes.rings import bounded_count
from qstore.storage.statements import receipt_open
from qstore.storage.targets import Blocked, guarded
from qstore.types import PruneOutcome, RotateOutcome, SkipReason

__all__ = ["claim_slot_bytes", "oldest_initialised_slot", "prune_oldest", "prune_oldest_claims", "prune_oldest_leases", "rotate",
           "rotate_claims", "rotate_leases", "vacuum_leases"]


#: Rows at the end of each lane the queue-ring prune probes for pending work before it
#: counts the slot's pending rows in full.
TAIL_PROBE = 8


@dataclass(frozen=True)
class QueueGates:
    """Gates G1-G3 and the fold/release statements of one queue slot."""

    active_leases: Select[Any]
    lanes_past_cursor: Select[Any]
    tail_pending: Select[Any]
    pending_ready: Select[Any]
    open_claims: Select[Any]
    ready_rows: Select[Any]


@functools.lru_cache(maxsize=4096)
def _queue_gates(sch: StorageSchema, k: int) -> QueueGates:
    r, t, crk, *_ = sch.queue_ring.children(k)
    crp = sch.claim_ranges.parent
    le, c = sch.leases.parent, sch.claims.parent

    def same_lane(x: Any, row: Any = r) -> Any:
        return and_(x.c.queue == row.c.queue, x.c.priority == row.c.priority,
                    x.c.enqueue_shard == row.c.enqueue_shard)

    def covered(cr: Any, row: Any) -> Any:
        # Ranges of a lane are disjoint (a claim consumes positions once), so the covering
        # range, if any, is the one with the greatest first_seq <= lane_seq: one index probe.
        # Were ranges ever to overlap this could only report a spent row as pending (safe).
        last = (select(cr.c.last_seq).where(same_lane(cr, row), cr.c.first_seq <= row.c.lane_seq)
                .order_by(cr.c.first_seq.desc()).limit(1).scalar_subquery())
        return func.coalesce(last >= row.c.lane_seq, false())

    def is_pending(row: Any) -> Any:
        # The slot's own range child first (where ranges live); the parent only for rows it
        # does not cover, so the common case costs one probe per row.
        tombstoned = select(t.c.lane_seq).where(same_lane(t, row), t.c.lane_seq == row.c.lane_seq).exists()
        return and_(~tombstoned, ~covered(crk, row), ~covered(crp, row))

    is_open = receipt_open(sch, c)
    pending = select(literal(1)).select_from(r).where(is_pending(r))
    # Claims consume a lane in position order, so a slot that still holds a backlog has
    # pending rows at the end of its lanes: probing the last few rows of every lane finds
    # them without visiting the claimed rows before them (the full count would).
    h = sch.claim_heads
    tail = (select(r.c.queue, r.c.priority, r.c.enqueue_shard, r.c.lane_seq)
            .where(same_lane(h)).order_by(r.c.lane_seq.desc()).limit(TAIL_PROBE).lateral("tail"))
    tail_pending = select(func.count()).select_from(h.join(tail, true())).where(is_pending(tail))
    # A lane's claim cursor (its claim sequence) is only moved over positions a claim found
    # covered by committed claim ranges, or spent (see claim_ready): a lane whose last row in
    # the slot lies at or below its cursor has no pending row there. Lanes are never deleted,
    # so every row of the slot has its lane's head here.
    last = (select(r.c.lane_seq).where(same_lane(h)).order_by(r.c.lane_seq.desc()).limit(1)
            .lateral("last_row"))
    cursor = func.coalesce(func.pg_sequence_last_value(h.c.claim_seq), 0)
    lanes_past_cursor = select(func.count()).select_from(h.join(last, true())).where(last.c.lane_seq > cursor)
    return QueueGates(
        active_leases=bounded_count(select(literal(1)).select_from(le).where(le.c.ready_slot == k)),
        lanes_past_cursor=lanes_past_cursor,
        tail_pending=tail_pending,
        pending_ready=bounded_count(pending),
        open_claims=bounded_count(select(literal(1)).select_from(c).where(c.c.ready_slot == k, is_open)),
        ready_rows=select(func.count()).select_from(r),
    )


@functools.lru_cache(maxsize=4096)
def _derived_gate(sch: StorageSchema, ring_name: str, k: int) -> Select[Any]:
    """Lease ring: live leases in slot ``k``; claim ring: claims of slot ``k`` without a
    closure in the same slot."""
    if ring_name == "lease":
        return bounded_count(select(literal(1)).select_from(sch.leases.children[k]))
    c = sch.claims.children[k]
    return bounded_count(select(literal(1)).select_from(c).where(receipt_open(sch, c, k)))


# -- rotate ----------------------------------------------------------------------------------
def _rotate(conn: Connection, sch: StorageSchema, ring: Ring) -> RotateOutcome:
    n = ring.slot_count
    ring_plane.lock_ring(conn, sch, ring)
    gen = ring_plane.generation(conn, ring)
    cur = gen % n
    if ring_plane.pristine(conn, ring, cur):
        return RotateOutcome.skipped_idle(cur, gen)
    nxt = (cur + 1) % n
    busy = ring_plane.busy(conn, ring, nxt)
    if busy.total():
        return RotateOutcome.skipped_busy(nxt, busy)
    # a sequence move, visible to every session at once: the policy gives rotation a
    # transaction of its own, so nothing after this statement can roll back under it
    ring_plane.advance(conn, ring, gen + 1)
    return RotateOutcome.rotated(nxt, gen + 1)


def rotate(ctx: StorageContext, conn: Connection) -> RotateOutcome:
    """Queue ring: move to ``(current+1) % N`` with ``generation+1`` if every child of the
    incoming slot (ready, tombstones, claim ranges, done, deltas) is empty. ``SkippedBusy``
    (with counts, saturating at ``BUSY_COUNT_CAP``) otherwise; ``SkippedIdle`` when the
    current slot was never written."""
    return _rotate(conn, ctx.schema, ctx.schema.queue_ring)


def rotate_leases(ctx: StorageContext, conn: Connection) -> RotateOutcome:
    """Lease ring rotation; the incoming lease child must hold no live lease (dead tuples
    are fine)."""
    return _rotate(conn, ctx.schema, ctx.schema.lease_ring)


def rotate_claims(ctx: StorageContext, conn: Connection) -> RotateOutcome:
    """Claim ring rotation; incoming claim and closure children empty."""
    return _rotate(conn, ctx.schema, ctx.schema.claim_ring)


def claim_slot_bytes(ctx: StorageContext, conn: Connection) -> int:
    """Bytes written to the claim ring's current slot since it was (re)initialised: the heap
    sizes of its receipt and closure children, summed (one statement, no lock beyond a
    read of those two children). A maintainer turns the ring once this passes a threshold
    (or the slot has been current long enough) instead of on a fixed clock, so the bytes a
    slot holds follow the claim volume, not the claim rate."""
    return ring_plane.current_bytes(conn, ctx.schema.claim_ring)


# -- prune: queue ring -----------------------------------------------------------------------
def _queue_gate_failure(conn: Connection, gates: QueueGates, k: int) -> PruneOutcome | None:
    # Each gate is its own statement (its own snapshot), so the order matters: pending ready
    # rows first. A claim commits its range and its lease or receipt together; if it commits
    # after the G2 statement, the G1/G3 statements that follow see its attempt. Checked the
    # other way round, a claim committing between the lease gate and G2 passes both.
    # G2 starts from the lanes' claim cursors (see _queue_gates); the per-row probes run only
    # when some lane has a row in the slot beyond its cursor.
    gates_to_run = [(gates.active_leases, SkipReason.QUEUE_ACTIVE_LEASES),
                    (gates.open_claims, SkipReason.QUEUE_OPEN_CLAIMS)]
    if int(conn.execute(gates.lanes_past_cursor).scalar_one()):
        gates_to_run[:0] = [(gates.tail_pending, SkipReason.QUEUE_PENDING_READY),
                            (gates.pending_ready, SkipReason.QUEUE_PENDING_READY)]
    for stmt, reason in gates_to_run:
        n = int(conn.execute(stmt).scalar_one())
        if n:
            return PruneOutcome.skipped_active(k, reason, n)
    return None


def _prune_queue_slot(conn: Connection, sch: StorageSchema, k: int) -> PruneOutcome:
    gates = _queue_gates(sch, k)
    # counted before the gates: a ready row committed after this count (a late writer) either
    # fails G2 below or changes the count the lock re-checks
    ready_rows = int(conn.execute(gates.ready_rows).scalar_one())
    early = _queue_gate_failure(conn, gates, k)
    if early is not None:
        return early
    ring_plane.lock_exclusive(conn, sch.queue_ring.children(k))
    # Under the lock, every row committed while it was awaited is visible. Once the gates
    # pass they can only fail again through a ready row that arrived since (a late writer
    # that read the ring cursor before a rotation): ready rows are never deleted, so an
    # unchanged count proves the early gates still hold and keeps the lock short.
    if int(conn.execute(gates.ready_rows).scalar_one()) != ready_rows:
        late = _queue_gate_failure(conn, gates, k)
        if late is not None:
            return late
    control.settle_pruned_slot(conn, sch, k)
    ring_plane.truncate_written(conn, sch.queue_ring, k)
    return PruneOutcome.pruned(k)


def prune_oldest(ctx: StorageContext, conn: Connection) -> PruneOutcome:
    """Prune the oldest sealed queue slot that holds anything (slots are taken oldest
    generation first; a slot already pruned and not written since is passed over).
    ``Noop`` when no sealed slot holds rows; ``SkippedActive`` with the first failing gate
    (checked G2 → G1 → G3) and its count; ``Blocked`` when the exclusive lock was not granted
    within 50 ms; else ``Pruned`` after appending the slot's terminal counts to the rollup
    ledger, releasing its jobs' unique keys and truncating its children."""
    sch = ctx.schema
    ring = sch.queue_ring
    n = ring.slot_count
    ring_plane.lock_ring(conn, sch, ring)
    cur = ring_plane.generation(conn, ring) % n
    clean = ring_plane.pristine_slots(conn, ring)
    k = next((slot for slot in ((cur + i) % n for i in range(1, n)) if not clean[slot]), None)
    if k is None:
        return PruneOutcome.noop()
    result = guarded(conn, lambda step: _prune_queue_slot(step, sch, k))
    return PruneOutcome.blocked(k) if isinstance(result, Blocked) else result


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
    # Sizes first: a slot already truncated and not written since needs no gate. (Reading
    # a size share-locks the child, so this too runs under the guard's lock timeout.)
    if ring_plane.pristine(conn, ring, k):
        return PruneOutcome.noop()
    gate = _derived_gate(sch, ring.name, k)
    n = int(conn.execute(gate).scalar_one())
    if n:
        return PruneOutcome.skipped_active(k, _ACTIVE[ring.name], n)
    ring_plane.lock_exclusive(conn, ring.children(k))
    n = int(conn.execute(gate).scalar_one())
    if n:
        return PruneOutcome.skipped_active(k, _ACTIVE[ring.name], n)
    ring_plane.truncate_written(conn, ring, k)
    return PruneOutcome.pruned(k)


def _prune_derived(conn: Connection, sch: StorageSchema, ring: Ring) -> PruneOutcome:
    n = ring.slot_count
    ring_plane.lock_ring(conn, sch, ring)
    gen = ring_plane.generation(conn, ring)
    cur = gen % n
    k = oldest_initialised_slot(cur, gen, n)
    if k is None:
        # Only the current slot was ever initialised: nothing to do if it is pristine,
        # otherwise its rows/dead tuples can only be reclaimed after a rotation.
        if ring_plane.pristine(conn, ring, cur):
            return PruneOutcome.noop()
        return PruneOutcome.skipped_active(cur, _CURRENT[ring.name], 0)
    result = guarded(conn, lambda step: _prune_derived_slot(step, sch, ring, k))
    return PruneOutcome.blocked(k) if isinstance(result, Blocked) else result


def prune_oldest_leases(ctx: StorageContext, conn: Connection) -> PruneOutcome:
    """Truncate the oldest initialised lease slot if it is not current (``LEASE_CURRENT``)
    and holds no lease (``LEASE_ACTIVE``, count). ``Noop`` when nothing needs reclaiming
    (never rotated and pristine, or the oldest slot is already truncated); ``Blocked`` on a
    lock timeout."""
    return _prune_derived(conn, ctx.schema, ctx.schema.lease_ring)


def prune_oldest_claims(ctx: StorageContext, conn: Connection) -> PruneOutcome:
    """Truncate the oldest initialised claim slot (claims + closures, one statement) if it
    is not current (``CLAIM_CURRENT``) and every claim in it has a closure in the same slot
    (``CLAIM_OPEN``, count of open claims)."""
    return _prune_derived(conn, ctx.schema, ctx.schema.claim_ring)


def vacuum_leases(ctx: StorageContext, conn: Connection) -> None:
    """``VACUUM <schema>.leases`` (all lease partitions), outside any transaction block.

    Fallback for a pinned lease ring (e.g. a long ``waiting_external`` lease keeps rotation
    from reaching its slot, so deleted leases accumulate)."""
    ring_plane.vacuum(conn, [ctx.schema.leases.parent])
