"""Terminal counters: delta rollup, rebuild and the trust marker.

The completion paths only ever *append* signed rows to ``queue_terminal_count_deltas``
(partitioned like the queue ring); no counter row is updated per completion. Counter
invariant, per retained slot ``k``::

    Σ live_counts(k) + Σ deltas(k) = count(done_entries_k)

and ``queue_terminal_rollups`` + ``queue_terminal_rollup_ledger`` hold the counts of slots
already pruned (a prune appends to the ledger; folding the ledger into the rollups is part
of the rollup below). Exact ``queue_counts`` read ``rollups + ledger + live counts +
deltas`` while the counters are trusted (``counter_state.terminal_counter_trusted_at``
set), a ``done_entries`` scan otherwise.

* :func:`rollup_terminal_count_deltas` folds the deltas of sealed, inactive slots into
  ``queue_terminal_live_counts`` and truncates their delta children, keeping the invariant,
  then folds the prune ledger into the rollups. These are the only counter writes that
  update rows, so the rollup stands down — touching nothing — while the MVCC horizon is
  *pinned*: while another client backend of this database holds a snapshot older than
  ``pinned_after`` (default 5 s). Ordinary short statements of busy workers do not stop it.
  ``TRUNCATE`` is not MVCC-safe (a snapshot that predates it sees the child empty while
  still seeing the old live counts); the reads that promise one snapshot (``load_job``, the
  status reports) hold the tables upkeep truncates before their snapshot is taken, so a
  rollup meeting them reports its slots blocked (see docs/design.md, "Consistent reads
  while upkeep truncates"). Seeing other sessions' snapshots requires superuser or
  ``pg_read_all_stats``; a role without it cannot see them and would not stand down.
* :func:`rebuild_terminal_counters` recomputes the live counts from ``done_entries`` under
  exclusive locks (writers wait meanwhile: run it on a quiesced fleet) and marks the
  counters trusted.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Select, bindparam, func, literal, or_, select
from sqlalchemy import column as sa_column
from sqlalchemy import table as sa_table
from sqlalchemy.dialects.postgresql import INTERVAL

from qstore.errors import ValidationError, failure_line
from qstore.schema import StorageSchema
from qstore.storage.context import StorageContext
from qstore.storage.planes import control
from qstore.storage.planes import rings as ring_plane
from qstore.storage.planes.rings import slot_generation
from qstore.storage.statements import receipt_open
from qstore.storage.targets import Blocked, Transactions, guarded
from qstore.types import TerminalDeltaRollupOutcome

__all__ = [
    "PINNED_AFTER",
    "REBUILD_LOCK_PREFIX",
    "mvcc_horizon_pinned",
    "rebuild_terminal_counters",
    "rollup_terminal_count_deltas",
    "terminal_counter_trusted",
]

log = logging.getLogger("qstore.storage")

#: Transaction advisory lock key prefix of :func:`rebuild_terminal_counters`.
REBUILD_LOCK_PREFIX = "qstore.rebuild_terminal_counters:"
_KEY = ("ready_slot", "queue", "priority", "enqueue_shard", "counter_bucket")
#: A snapshot held longer than this pins the horizon for the rollup (see the module doc).
PINNED_AFTER = timedelta(seconds=5)

_activity = sa_table(
    "pg_stat_activity",
    sa_column("pid"), sa_column("datname"), sa_column("backend_type"), sa_column("state"),
    sa_column("backend_xmin"), sa_column("backend_xid"), sa_column("xact_start"),
    sa_column("query_start"),
    schema="pg_catalog",
)

_PINNED = select(
    select(literal(1)).select_from(_activity).where(
        _activity.c.datname == func.current_database(),
        _activity.c.pid != func.pg_backend_pid(),
        _activity.c.backend_type == "client backend",
        or_(_activity.c.backend_xmin.isnot(None), _activity.c.backend_xid.isnot(None)),
        # the oldest snapshot a backend can hold is its transaction's first
        func.coalesce(_activity.c.xact_start, _activity.c.query_start)
        < func.clock_timestamp() - bindparam("pinned_after", type_=INTERVAL()),
    ).exists()
)


def mvcc_horizon_pinned(conn: Connection, pinned_after: timedelta = PINNED_AFTER) -> bool:
    """True when another client backend of this database has held a snapshot (or a
    transaction id) since more than ``pinned_after`` ago."""
    return bool(conn.execute(_PINNED, {"pinned_after": pinned_after}).scalar())


@dataclass(frozen=True)
class SlotRollup:
    """The statements that fold one sealed slot's deltas."""

    has_deltas: Select[Any]
    active: Select[Any]


@functools.lru_cache(maxsize=4096)
def _slot_rollup(sch: StorageSchema, k: int) -> SlotRollup:
    dl = sch.deltas.children[k]
    le, c = sch.leases.parent, sch.claims.parent
    return SlotRollup(
        has_deltas=select(select(literal(1)).select_from(dl).exists()),
        active=select(or_(
            select(literal(1)).select_from(le).where(le.c.ready_slot == k).exists(),
            select(literal(1)).select_from(c).where(
                c.c.ready_slot == k, receipt_open(sch, c)).exists(),
        )),
    )


class _Slot(enum.Enum):
    """What a rollup found at one slot."""

    ROLLED = "rolled"
    ACTIVE = "active"  # still referenced by an attempt: deltas may arrive
    BLOCKED = "blocked"  # its delta child's lock was not granted in time
    PINNED = "pinned"  # the MVCC horizon is pinned: the whole rollup stands down
    GONE = "gone"  # re-initialised since it was listed


@dataclass(frozen=True)
class _SlotResult:
    kind: _Slot
    delta_rows: int = 0
    grouped_keys: int = 0


def _rollup_slot(conn: Connection, sch: StorageSchema, k: int, gen: int, pinned_after: timedelta) -> _SlotResult:
    st = _slot_rollup(sch, k)
    ring = sch.queue_ring
    ring_plane.lock_ring(conn, sch, ring)
    now = ring_plane.generation(conn, ring)
    if now % ring.slot_count == k:
        return _SlotResult(_Slot.ACTIVE)
    if slot_generation(now, k, ring.slot_count) != gen:
        return _SlotResult(_Slot.GONE)  # re-initialised since it was listed
    if mvcc_horizon_pinned(conn, pinned_after):
        return _SlotResult(_Slot.PINNED)

    def locked(step: Connection) -> _SlotResult:
        ring_plane.lock_exclusive(step, [sch.deltas.children[k]])
        if mvcc_horizon_pinned(step, pinned_after):
            return _SlotResult(_Slot.PINNED)
        if step.execute(st.active).scalar():
            return _SlotResult(_Slot.ACTIVE)  # deltas may still arrive for this slot
        delta_rows, keys = control.fold_slot_deltas(step, sch, k)
        if delta_rows:
            ring_plane.truncate_child(step, sch.deltas, k)
        return _SlotResult(_Slot.ROLLED, delta_rows, keys)

    result = guarded(conn, locked)
    return _SlotResult(_Slot.BLOCKED) if isinstance(result, Blocked) else result


def rollup_terminal_count_deltas(ctx: StorageContext, tx: Transactions, max_slots: int, *,
                                 pinned_after: timedelta | None = None) -> TerminalDeltaRollupOutcome:
    """Fold the deltas of up to ``max_slots`` sealed slots into the live counters, then the
    prune ledger into the rollups, standing down while a snapshot older than
    ``pinned_after`` (default 5 s) pins the horizon.

    Candidates: sealed slots (not current, initialised) whose delta child has rows, oldest
    generation first. Each slot is one unit (its own transaction with an Engine): the
    queue-ring lock; stand down for the whole call if the horizon is pinned
    (``skipped_mvcc_pinned``, nothing touched); ``lock_timeout`` 50 ms + ``ACCESS
    EXCLUSIVE`` on the delta child (``blocked_slots`` on timeout); skip a slot still
    referenced by a lease or an open claim (``skipped_active_slots``); add the non-zero sums
    per ``(ready_slot, queue, priority, enqueue_shard, counter_bucket)`` into the live counts
    (floor 0) and truncate the delta child. ``max_slots == 0`` folds no slot (the ledger is
    still folded).

    With an Engine, if a later slot fails, the error is logged and the outcome reports the
    slots already folded (their folds stand and the counts are exact either way); an error
    before anything was folded is raised.
    """
    if pinned_after is None:
        pinned_after = PINNED_AFTER
    elif not isinstance(pinned_after, timedelta) or pinned_after < timedelta(0):
        raise ValidationError("pinned_after", pinned_after, "must be a non-negative timedelta")
    sch = ctx.schema
    ring = sch.queue_ring
    n = ring.slot_count
    with tx.unit() as conn:
        now = ring_plane.generation(conn, ring)
        cur = now % n
        candidates = [
            (slot, slot_generation(now, slot, n)) for slot in ((cur + i) % n for i in range(1, n))
            if slot_generation(now, slot, n) >= 0 and conn.execute(_slot_rollup(sch, slot).has_deltas).scalar()
        ]
    rolled = delta_rows = keys = active = blocked = 0
    pinned = False
    try:
        for slot, gen in candidates:
            if rolled >= max_slots:
                break
            with tx.unit() as conn:
                res = _rollup_slot(conn, sch, slot, gen, pinned_after)
            if res.kind is _Slot.PINNED:
                pinned = True
                break
            if res.kind is _Slot.ROLLED:
                rolled += 1
                delta_rows += res.delta_rows
                keys += res.grouped_keys
            elif res.kind is _Slot.ACTIVE:
                active += 1
            elif res.kind is _Slot.BLOCKED:
                blocked += 1
        if not pinned:
            with tx.unit() as conn:
                ring_plane.lock_ring(conn, sch, ring)
                if mvcc_horizon_pinned(conn, pinned_after):
                    pinned = True
                else:
                    control.fold_ledger(conn, sch)
    except Exception as err:
        if not rolled or not tx.owned:
            raise
        log.warning("qstore: counter rollup failed after folding %d slots: %s", rolled, failure_line(err))
        log.debug("qstore: counter rollup failed here:", exc_info=True)
    return TerminalDeltaRollupOutcome(
        rolled_slots=rolled, delta_rows=delta_rows, grouped_keys=keys,
        skipped_active_slots=active, blocked_slots=blocked, skipped_mvcc_pinned=pinned,
    )


def rebuild_terminal_counters(ctx: StorageContext, conn: Connection) -> int:
    """Recompute ``queue_terminal_live_counts`` from ``done_entries`` and mark the counters
    trusted; returns the number of counter rows written.

    Under the transaction advisory lock ``qstore.rebuild_terminal_counters:<schema>`` and
    the queue-ring lock, ``done_entries``, ``done_batches``, the delta ledger and the live counts are locked
    ``ACCESS EXCLUSIVE`` (no timeout: completions wait until the rebuild commits), the live
    counts and every delta child are truncated and the live counts re-aggregated. Pruned
    history (rollups, ledger) is left as it is."""
    sch = ctx.schema
    key = f"{REBUILD_LOCK_PREFIX}{sch.config.schema}"
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(key, 0))))
    ring_plane.lock_ring(conn, sch, sch.queue_ring)
    ring_plane.lock_exclusive(conn, [sch.done.parent, sch.done_batches.parent, sch.deltas.parent, sch.live_counts])
    ring_plane.truncate_family(conn, sch.deltas)
    return control.rebuild_live_counts(conn, sch)


def terminal_counter_trusted(ctx: StorageContext, conn: Connection) -> bool:
    """True when ``counter_state.terminal_counter_trusted_at`` is set (False if the row is
    missing)."""
    return control.counters_trusted(conn, ctx.schema)
