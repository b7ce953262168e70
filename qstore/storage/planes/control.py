"""Control plane: the only Python writer of lanes (through the install's ``reserve_lanes``
function), unique-key ownership, queue options, claimer slots, the terminal counters and
the backend registry.

* **Lanes**: ``reserve_lanes`` creates a lane on first use and hands out consecutive
  positions under a transaction-scoped lock held until the enqueue commits, so "position
  N+1 visible" implies "position N committed or aborted".
* **Unique keys**: a job owns its key while its state's bit is set in its
  ``unique_states`` mask; every transition syncs ownership (acquire first, then release).
  A release appends a ``job_unique_releases`` row naming the claim's ``claim_id`` (no row
  updated or deleted, so no dead tuple while the MVCC horizon is pinned); a released key is
  free and taken over in place; :func:`purge_released_keys` deletes released claims.
* **Counters**: deltas are appended by the queue plane; here the rollup folds them into
  the live counts, prunes append their ground-truth folds to the ledger, and the ledger is
  folded into the permanent rollups.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Delete,
    Insert,
    Integer,
    Select,
    SmallInteger,
    Text,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import INTERVAL, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.dml import Insert as PgInsert
from sqlalchemy.sql.dml import Update

from qstore.config import COUNTER_BUCKETS
from qstore.errors import UniqueConflictError, ValidationError
from qstore.schema import StorageSchema
from qstore.schema.queue_plane import at_lane_position, batch_member_total, done_members
from qstore.storage.jobs import holds_key
from qstore.storage.statements import packed_array_param, schema_func
from qstore.types import JobState, QueueClaimerLease

__all__ = [
    "BACKEND",
    "ControlStatements",
    "Transition",
    "acquire_keys",
    "purge_released_keys",
    "release_keys",
    "reserve_lanes",
    "statements",
    "sync_keys",
    "takes_key",
    "try_acquire_keys",
]

BACKEND = "queue_storage"
_PG = postgresql.dialect()
#: How long a shared claimer target stays fresh before one claimer recomputes it.
TARGET_REFRESH = timedelta(milliseconds=500)
_COUNTER_KEY = ("ready_slot", "queue", "priority", "enqueue_shard", "counter_bucket")


@dataclass(frozen=True)
class ControlStatements:
    """The control plane's statements for one install, built once."""

    reserve: Select[Any]
    shards: Select[Any]
    lock_head: Select[Any]
    meta_dlq: Select[Any]
    claimer_owned: Select[Any]
    claimer_take: Update
    claimer_insert: Insert
    claimer_mark: Update
    claimer_needs_refresh: Select[Any]
    claimer_state: Select[Any]
    claimer_available: Select[Any]
    claimer_upsert_state: PgInsert
    counters_trusted: Select[Any]
    counters_mark_trusted: Update
    counters_rebuild: Insert
    counters_live_rows: Select[Any]
    ledger_nonempty: Select[Any]
    ledger_fold: Insert


@functools.lru_cache(maxsize=64)
def statements(sch: StorageSchema) -> ControlStatements:
    h, m = sch.claim_heads, sch.queue_meta
    t, st = sch.claimer_leases, sch.claimer_state
    now = func.clock_timestamp()
    q = bindparam("q_name", type_=Text())
    me = bindparam("me", type_=UUID(as_uuid=True))
    slot = bindparam("q_slot", type_=SmallInteger())
    ttl = bindparam("ttl", type_=INTERVAL())
    idle = bindparam("idle", type_=INTERVAL())
    last = lambda seq: func.coalesce(func.pg_sequence_last_value(seq), 0)  # noqa: E731
    cs, d, live = sch.counter_state, sch.done.parent, sch.live_counts
    rollups, ledger = sch.rollups, sch.rollup_ledger
    # every done row counts once, every member of a batch done row once
    members = done_members(sch.done_batches.parent)
    done_keys = union_all(
        select(d.c.ready_slot, d.c.queue, d.c.priority, d.c.enqueue_shard, d.c.job_id),
        select(members.c.ready_slot, members.c.queue, members.c.priority, members.c.enqueue_shard,
               members.c.job_id),
    ).subquery("done_keys")
    bucket = (done_keys.c.job_id % COUNTER_BUCKETS).cast(SmallInteger)
    group = (done_keys.c.ready_slot, done_keys.c.queue, done_keys.c.priority, done_keys.c.enqueue_shard, bucket)
    moved = delete(ledger).returning(ledger.c.queue, ledger.c.priority, ledger.c.pruned_count).cte("moved")
    total = func.sum(moved.c.pruned_count)
    fold = pg_insert(rollups).from_select(
        ["queue", "priority", "pruned_completed_count"],
        select(moved.c.queue, moved.c.priority, total).group_by(moved.c.queue, moved.c.priority)
        .order_by(moved.c.queue, moved.c.priority),
    )
    fold = fold.on_conflict_do_update(
        index_elements=[rollups.c.queue, rollups.c.priority],
        set_={"pruned_completed_count": func.greatest(
            0, rollups.c.pruned_completed_count + fold.excluded.pruned_completed_count)},
    )
    return ControlStatements(
        reserve=select(schema_func(
            sch, "reserve_lanes",
            packed_array_param("queues", Text()), packed_array_param("logicals", Text()),
            packed_array_param("priorities", SmallInteger()), packed_array_param("shards", SmallInteger()),
            packed_array_param("counts", Integer()),
        )),
        shards=select(m.c.queue, m.c.enqueue_shards).where(m.c.queue.in_(bindparam("logicals", expanding=True))),
        lock_head=select(h.c.queue).where(h.c.queue == bindparam("k_queue"), h.c.priority == bindparam("k_priority"),
                                          h.c.enqueue_shard == bindparam("k_shard")).with_for_update(),
        meta_dlq=select(m.c.queue).where(m.c.queue.in_(bindparam("queues", expanding=True)), m.c.dlq_enabled),
        claimer_owned=select(t.c.claimer_slot, t.c.lease_epoch).where(
            t.c.queue == q, t.c.owner_instance_id == me, t.c.expires_at > now,
            t.c.claimer_slot < bindparam("max", type_=Integer())).order_by(t.c.claimer_slot).limit(1),
        claimer_take=update(t).where(
            t.c.queue == q, t.c.claimer_slot == slot,
            or_(t.c.owner_instance_id == me, t.c.expires_at <= now, t.c.last_claimed_at <= now - idle),
        ).values(
            lease_epoch=t.c.lease_epoch + case((t.c.owner_instance_id != me, 1), else_=0),
            owner_instance_id=me, leased_at=now, last_claimed_at=now, expires_at=now + ttl,
        ).returning(t.c.claimer_slot, t.c.lease_epoch),
        claimer_insert=pg_insert(t).values(
            queue=q, claimer_slot=slot, owner_instance_id=me, lease_epoch=0, leased_at=now,
            last_claimed_at=now, expires_at=now + ttl,
        ).on_conflict_do_nothing().returning(t.c.claimer_slot, t.c.lease_epoch),
        claimer_mark=update(t).where(
            t.c.queue == q, t.c.claimer_slot == slot, t.c.owner_instance_id == me,
            t.c.lease_epoch == bindparam("q_epoch"),
        ).values(last_claimed_at=now, expires_at=now + ttl),
        claimer_needs_refresh=select(or_(t.c.last_claimed_at <= now - idle, t.c.expires_at <= now + ttl)).where(
            t.c.queue == q, t.c.claimer_slot == slot, t.c.owner_instance_id == me),
        claimer_state=select(st.c.target_claimers,
                             st.c.updated_at > now - literal(TARGET_REFRESH, INTERVAL())).where(st.c.queue == q),
        claimer_available=select(func.coalesce(func.sum(func.greatest(last(h.c.enqueue_seq) - last(h.c.claim_seq), 0)), 0))
        .where(h.c.queue.in_(bindparam("queues", expanding=True))),
        claimer_upsert_state=pg_insert(st).values(
            queue=q, target_claimers=bindparam("q_target", type_=SmallInteger()), updated_at=now),
        counters_trusted=select(cs.c.terminal_counter_trusted_at.isnot(None)),
        counters_mark_trusted=update(cs).values(terminal_counter_trusted_at=func.now()),
        counters_rebuild=insert(live).from_select(
            [*_COUNTER_KEY, "live_terminal_count"],
            select(*group, func.count()).group_by(*group).order_by(*group)),
        counters_live_rows=select(func.count()).select_from(live),
        ledger_nonempty=select(select(literal(1)).select_from(ledger).exists()),
        ledger_fold=fold,
    )


# -- lanes ------------------------------------------------------------------------------------
def reserve_lanes(conn: Connection, sch: StorageSchema,
                  lanes: Sequence[tuple[str, str, int, int, int]]) -> list[int]:
    """Reserve positions in each ``(queue, logical queue, priority, shard, count)`` lane, in
    the given (sorted) order; returns each lane's first position. Lanes are created on
    first use; each lane's reservation lock is held until the transaction ends."""
    return list(conn.execute(statements(sch).reserve, {
        "queues": [q for q, _, _, _, _ in lanes], "logicals": [lq for _, lq, _, _, _ in lanes],
        "priorities": [p for _, _, p, _, _ in lanes], "shards": [s for _, _, _, s, _ in lanes],
        "counts": [n for _, _, _, _, n in lanes],
    }).scalar_one())


def read_shards(conn: Connection, sch: StorageSchema, logicals: list[str]) -> dict[str, int]:
    """``queue_meta.enqueue_shards`` of the given logical queues that have a row."""
    return {q: int(n) for q, n in conn.execute(statements(sch).shards, {"logicals": logicals})}


def lock_lane_head(conn: Connection, sch: StorageSchema, queue: str, priority: int, shard: int) -> None:
    """Lock a lane's claim head (``FOR UPDATE``): no claim of the lane runs until the
    transaction ends."""
    conn.execute(statements(sch).lock_head, {"k_queue": queue, "k_priority": priority, "k_shard": shard}).first()


def dlq_enabled(conn: Connection, sch: StorageSchema, logicals: set[str]) -> set[str]:
    """Those of ``logicals`` whose DLQ policy is on."""
    if not logicals:
        return set()
    return set(conn.execute(statements(sch).meta_dlq, {"queues": sorted(logicals)}).scalars())


def set_queue_options(conn: Connection, sch: StorageSchema, queue: str, values: dict[str, Any]) -> None:
    """Upsert the logical queue's ``queue_meta`` row with ``values`` (none: ensure it exists)."""
    m = sch.queue_meta
    stmt = pg_insert(m).values(queue=queue, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=[m.c.queue], set_=values) if values
                 else stmt.on_conflict_do_nothing())


# -- unique keys -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transition:
    job_id: int
    unique_key: bytes | None
    unique_states: str | None
    old: JobState | None  # None = the job is new
    new: JobState | None  # None = the job is gone, or does not hold its key


def takes_key(tr: Transition) -> bool:
    """Whether ``tr`` makes its job take its unique key (held in the new state, not the old)."""
    return (tr.unique_key is not None and tr.new is not None and holds_key(tr.unique_states, tr.new)
            and not (tr.old is not None and holds_key(tr.unique_states, tr.old)))


def _released(sch: StorageSchema) -> Any:
    """``EXISTS`` a release of the claim row ``job_unique_claims`` (correlated)."""
    t, rel = sch.unique_claims, sch.unique_releases
    return select(literal(1)).select_from(rel).where(rel.c.claim_id == t.c.claim_id).correlate(t).exists()


def _released_in_conflict(sch: StorageSchema) -> Any:
    """:func:`_released` for the ``WHERE`` of ``ON CONFLICT … DO UPDATE`` (written out:
    SQLAlchemy renders a subquery there without its schema and without correlation)."""
    t, rel = sch.unique_claims, sch.unique_releases
    prep = _PG.identifier_preparer
    return text(f"EXISTS (SELECT 1 FROM {prep.format_table(rel)} r "
                f"WHERE r.claim_id = {prep.format_table(t)}.claim_id)")


def _claim_keys(sch: StorageSchema, owners: dict[bytes, int]) -> Any:
    """Take each key for its job: a new claim row, or the key's row taken over in place when
    its claim was released (the trigger gives it a new ``claim_id``) or is already the
    job's. The row lock makes one of concurrent takers of a released key win; the others
    re-check the winner's row, which no release names, and take nothing."""
    t = sch.unique_claims
    ins = pg_insert(t).values([{"unique_key": k, "job_id": j} for k, j in owners.items()])
    return ins.on_conflict_do_update(
        index_elements=[t.c.unique_key],
        set_={"job_id": ins.excluded.job_id},
        where=or_(t.c.job_id == ins.excluded.job_id, _released_in_conflict(sch)),
    ).returning(t.c.unique_key)


def _owners(sch: StorageSchema, keys: Sequence[bytes]) -> Select[Any]:
    """``(unique_key, job_id)`` of the keys among ``keys`` that are owned (claimed, not released)."""
    t = sch.unique_claims
    return select(t.c.unique_key, t.c.job_id).where(t.c.unique_key.in_(keys), ~_released(sch))


def acquire_keys(conn: Connection, sch: StorageSchema, owners: Sequence[tuple[bytes, int]]) -> None:
    """Take ``(key, job_id)`` ownership; a key owned by another job (or named twice in one
    batch) raises :class:`UniqueConflictError` (the caller's transaction must not commit).
    A released key is free."""
    if not owners:
        return
    seen: dict[bytes, int] = {}
    for key, job_id in owners:
        if seen.setdefault(key, job_id) != job_id:
            raise UniqueConflictError("job_unique_claims", f"duplicate unique key {key.hex()} in one batch")
    got = set(conn.execute(_claim_keys(sch, seen)).scalars())
    missing = [k for k in seen if k not in got]
    if missing:
        owned: dict[bytes, int] = {k: j for k, j in conn.execute(_owners(sch, missing[:1]))}
        owner = owned.get(missing[0])
        raise UniqueConflictError("job_unique_claims", f"unique key {missing[0].hex()} is owned by job {owner}")


def try_acquire_keys(conn: Connection, sch: StorageSchema, owners: Sequence[tuple[bytes, int]]) -> dict[int, int]:
    """Take ``(key, job_id)`` ownership where the key is free (never claimed, or released) or
    already the job's; never raises for a key owned by another job. Returns ``{job_id:
    owning job_id}`` (-1: owner unknown) for the jobs that did not get their key; within
    ``owners`` the first job naming a key wins it."""
    lost: dict[int, int] = {}
    first: dict[bytes, int] = {}
    for key, job_id in owners:
        winner = first.setdefault(key, job_id)
        if winner != job_id:
            lost[job_id] = winner
    if not first:
        return lost
    got = set(conn.execute(_claim_keys(sch, first)).scalars())
    missing = [k for k in first if k not in got]
    if missing:
        owner: dict[bytes, int] = {k: j for k, j in conn.execute(_owners(sch, missing))}
        for key in missing:
            lost[first[key]] = owner.get(key, -1)
    return lost


def _release(sch: StorageSchema, owned: Any) -> Insert:
    """Append a release for each claim row matching ``owned`` (a condition on
    ``job_unique_claims``) that is not released yet. Nothing is deleted."""
    t, rel = sch.unique_claims, sch.unique_releases
    return pg_insert(rel).from_select(
        ["claim_id", "unique_key", "job_id"],
        select(t.c.claim_id, t.c.unique_key, t.c.job_id).where(owned, ~_released(sch)).order_by(t.c.claim_id),
    ).on_conflict_do_nothing(index_elements=[rel.c.claim_id])


def release_keys(conn: Connection, sch: StorageSchema, owners: Iterable[tuple[bytes, int]]) -> None:
    """Give up ``(key, job_id)`` ownership (only where that job still owns the key): one
    appended release row per key, no row updated or deleted. The key is free at once."""
    pairs = list(owners)
    if not pairs:
        return
    t = sch.unique_claims
    conn.execute(_release(sch, tuple_(t.c.unique_key, t.c.job_id).in_(pairs)))


@functools.lru_cache(maxsize=64)
def _purge_statements(sch: StorageSchema) -> tuple[Delete, Delete]:
    t, rel = sch.unique_claims, sch.unique_releases
    claims = delete(t).where(_released(sch))
    # releases whose claim is gone or was taken again since (its claim_id renewed)
    orphans = delete(rel).where(~select(literal(1)).select_from(t).where(
        t.c.unique_key == rel.c.unique_key, t.c.claim_id == rel.c.claim_id).exists())
    return claims, orphans


def purge_released_keys(conn: Connection, sch: StorageSchema) -> int:
    """Delete the released claim rows, then every release row whose claim row is gone (or
    no longer carries its ``claim_id``); returns how many claim rows went. A key taken over
    meanwhile keeps its row (its new ``claim_id`` has no release): the delete re-checks a
    row updated since its snapshot."""
    claims, orphans = _purge_statements(sch)
    n = conn.execute(claims).rowcount
    conn.execute(orphans)
    return int(n)


def sync_keys(conn: Connection, sch: StorageSchema, transitions: Iterable[Transition]) -> None:
    """Apply the ownership changes ``transitions`` imply (acquire first, then release)."""
    take: list[tuple[bytes, int]] = []
    drop: list[tuple[bytes, int]] = []
    for tr in transitions:
        if tr.unique_key is None:
            continue
        had = tr.old is not None and holds_key(tr.unique_states, tr.old)
        has = tr.new is not None and holds_key(tr.unique_states, tr.new)
        if has and not had:
            take.append((tr.unique_key, tr.job_id))
        elif had and not has:
            drop.append((tr.unique_key, tr.job_id))
    acquire_keys(conn, sch, take)
    release_keys(conn, sch, drop)


# -- claimer slots ----------------------------------------------------------------------------
def claimer_acquire(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID, max_claimers: int,
                    lease_ttl: timedelta, idle_threshold: timedelta) -> QueueClaimerLease | None:
    """Keep this instance's unexpired slot, else take over an expired/idle one (epoch + 1
    on owner change) or insert a free one; None when every slot is busy."""
    if max_claimers <= 0:
        return None
    s = statements(sch)
    base = {"q_name": queue, "me": instance_id}
    row = conn.execute(s.claimer_owned, {**base, "max": max_claimers}).first()
    if row is not None:
        return QueueClaimerLease(row.claimer_slot, row.lease_epoch)
    start = (instance_id.int ^ int(time.time() * 1000)) % max_claimers
    args = {**base, "ttl": lease_ttl, "idle": idle_threshold}
    for i in range(max_claimers):
        slot = (start + i) % max_claimers
        row = conn.execute(s.claimer_take, {**args, "q_slot": slot}).first()
        if row is None:
            row = conn.execute(s.claimer_insert, {**args, "q_slot": slot}).first()
        if row is not None:
            return QueueClaimerLease(row.claimer_slot, row.lease_epoch)
    return None


def claimer_mark_active(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID,
                        lease: QueueClaimerLease, lease_ttl: timedelta) -> bool:
    """Refresh the slot if slot, owner and epoch still match (False = the slot was lost)."""
    res = conn.execute(statements(sch).claimer_mark, {
        "q_name": queue, "q_slot": lease.claimer_slot, "me": instance_id, "q_epoch": lease.lease_epoch,
        "ttl": lease_ttl,
    })
    return res.rowcount == 1


def claimer_needs_refresh(conn: Connection, sch: StorageSchema, queue: str, instance_id: uuid.UUID,
                          lease: QueueClaimerLease, lease_ttl: timedelta, idle_threshold: timedelta) -> bool:
    """Whether the slot is half-way to idle or to expiry (then the claim refreshes it)."""
    return bool(conn.execute(statements(sch).claimer_needs_refresh, {
        "q_name": queue, "q_slot": lease.claimer_slot, "me": instance_id,
        "idle": idle_threshold / 2, "ttl": lease_ttl / 2,
    }).scalar())


def desired_claimers(current: int, available: int, max_claimers: int) -> int:
    """Hysteresis on the current target: grow with the backlog, shrink when it drains."""
    if current >= 4:
        want = 4 if available >= 16 else 2 if available >= 4 else 1
    elif current >= 2:
        want = 4 if available >= 64 else 2 if available >= 2 else 1
    else:
        want = 4 if available >= 32 else 2 if available >= 4 else 1
    return max(1, min(want, max_claimers))


def claimer_target(conn: Connection, sch: StorageSchema, queue: str, physical: list[str], max_claimers: int) -> int:
    """The shared claimer target for ``queue``: the stored one while fresh, else recomputed
    from Σ(enqueue - claim cursor) over its ``physical`` queues and upserted (one
    refresher wins)."""
    s = statements(sch)
    row = conn.execute(s.claimer_state, {"q_name": queue}).first()
    if row is not None and row[1]:
        return max(1, min(int(row[0]), max_claimers))
    available = int(conn.execute(s.claimer_available, {"queues": physical}).scalar_one())
    target = desired_claimers(int(row[0]) if row is not None else 1, available, max_claimers)
    st = sch.claimer_state
    stmt = s.claimer_upsert_state
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[st.c.queue],
        set_={"target_claimers": stmt.excluded.target_claimers, "updated_at": stmt.excluded.updated_at},
        where=st.c.updated_at <= func.clock_timestamp() - literal(TARGET_REFRESH, INTERVAL()),
    ), {"q_name": queue, "q_target": target})
    return target


# -- terminal counters ------------------------------------------------------------------------
def counters_trusted(conn: Connection, sch: StorageSchema) -> bool:
    return bool(conn.execute(statements(sch).counters_trusted).scalar())


def rebuild_live_counts(conn: Connection, sch: StorageSchema) -> int:
    """Empty the live counts (``TRUNCATE``), recompute them from ``done_entries`` and mark
    the counters trusted; returns the number of counter rows written. The caller holds
    ``done_entries``, the deltas and the live counts ``ACCESS EXCLUSIVE`` and has emptied
    the deltas."""
    s = statements(sch)
    live = sch.live_counts
    conn.execute(text(f"TRUNCATE {conn.dialect.identifier_preparer.format_table(live)}"))
    conn.execute(s.counters_rebuild)
    conn.execute(s.counters_mark_trusted)
    # the table was emptied above, so its size is exactly what was written
    return int(conn.execute(s.counters_live_rows).scalar_one())


def fold_ledger(conn: Connection, sch: StorageSchema) -> bool:
    """Move the prune ledger's rows into ``queue_terminal_rollups`` (one statement; the sums
    are unchanged). Returns whether there was anything to fold."""
    s = statements(sch)
    if not conn.execute(s.ledger_nonempty).scalar():
        return False
    conn.execute(s.ledger_fold)
    return True


@dataclass(frozen=True)
class SlotStatements:
    """The control plane's statements about one queue slot, built once."""

    ledger_append: Insert
    drop_live: Delete
    release_keys: Insert
    delta_stats: Select[Any]
    fold_deltas: Insert


@functools.lru_cache(maxsize=4096)
def slot_statements(sch: StorageSchema, k: int) -> SlotStatements:
    r, _t, _cr, d, dl, db = sch.queue_ring.children(k)
    ledger, live, u = sch.rollup_ledger, sch.live_counts, sch.unique_claims
    # ground truth of the slot's terminal history, appended to the ledger (no row updated):
    # its done rows and the members of its batch done rows
    per = union_all(
        select(d.c.queue, d.c.priority, func.count().label("n")).group_by(d.c.queue, d.c.priority),
        select(db.c.queue, db.c.priority, batch_member_total(db).cast(BigInteger).label("n"))
        .group_by(db.c.queue, db.c.priority),
    ).subquery("per")
    n = func.sum(per.c.n)
    ledger_append = insert(ledger).from_select(
        ["queue", "priority", "pruned_count"],
        select(per.c.queue, per.c.priority, n.cast(BigInteger)).group_by(per.c.queue, per.c.priority)
        .having(n > 0).order_by(per.c.queue, per.c.priority),
    )
    # the jobs of the slot's done rows and batch members and the keys they hold (a narrow
    # done row's key, and a member's, is its ready row's)
    key = func.coalesce(d.c.unique_key, r.c.unique_key)
    m = done_members(db)
    owners = union_all(
        select(key.label("unique_key"), d.c.job_id)
        .select_from(d.outerjoin(r, at_lane_position(r, d)))
        .where(key.isnot(None)),
        select(r.c.unique_key, m.c.job_id)
        .select_from(m.join(r, at_lane_position(r, m)))
        .where(r.c.unique_key.isnot(None)),
    ).subquery("owners")
    total = func.sum(dl.c.terminal_delta)
    grouped = (
        select(*(dl.c[c] for c in _COUNTER_KEY), total.label("delta"))
        .group_by(*(dl.c[c] for c in _COUNTER_KEY))
        .having(total != 0)
        .cte("grouped")
    )
    existing = select(live.c.ready_slot).where(*(live.c[c] == grouped.c[c] for c in _COUNTER_KEY)).exists()
    fold = pg_insert(live).from_select(
        [*_COUNTER_KEY, "live_terminal_count"],
        select(*(grouped.c[c] for c in _COUNTER_KEY), grouped.c.delta)
        .where(or_(grouped.c.delta > 0, existing))
        .order_by(*(grouped.c[c] for c in _COUNTER_KEY)),
    )
    fold = fold.on_conflict_do_update(
        index_elements=[live.c[c] for c in _COUNTER_KEY],
        set_={"live_terminal_count": func.greatest(0, live.c.live_terminal_count + fold.excluded.live_terminal_count)},
    )
    return SlotStatements(
        ledger_append=ledger_append,
        drop_live=delete(live).where(live.c.ready_slot == k),
        release_keys=_release(sch, tuple_(u.c.unique_key, u.c.job_id).in_(select(owners.c.unique_key, owners.c.job_id))),
        delta_stats=select(
            select(func.count()).select_from(dl).scalar_subquery(),
            select(func.count()).select_from(grouped).scalar_subquery(),
        ),
        fold_deltas=fold,
    )


def settle_pruned_slot(conn: Connection, sch: StorageSchema, k: int) -> None:
    """At a prune of queue slot ``k``, in its transaction and before its children are
    truncated: append the slot's ground-truth terminal counts (``count(done_k)`` by queue and
    priority) to the ledger, drop the slot's live counts, and release the unique keys its
    done rows' jobs own (only where that job still owns the key: an appended release row
    each, see :func:`release_keys`)."""
    s = slot_statements(sch, k)
    conn.execute(s.ledger_append)
    conn.execute(s.drop_live)
    conn.execute(s.release_keys)


def fold_slot_deltas(conn: Connection, sch: StorageSchema, k: int) -> tuple[int, int]:
    """At a counter rollup of sealed queue slot ``k`` (its delta child locked): add its
    non-zero delta sums per counter key into the live counts (floor 0). Returns the slot's
    delta rows and the keys they group into (``(0, 0)``: nothing to fold, nothing sent but
    the count)."""
    s = slot_statements(sch, k)
    delta_rows, keys = conn.execute(s.delta_stats).one()
    if delta_rows:
        conn.execute(s.fold_deltas)
    return int(delta_rows), int(keys)


# -- the backend registry ---------------------------------------------------------------------
def activate(conn: Connection, sch: StorageSchema) -> None:
    """Register the install as the active queue-storage backend (idempotent)."""
    stmt = pg_insert(sch.backends).values(backend=BACKEND, schema_name=sch.config.schema)
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[sch.backends.c.backend],
        set_={"schema_name": stmt.excluded.schema_name, "updated_at": func.clock_timestamp()},
    ))
    res = conn.execute(
        update(sch.transition)
        .where(sch.transition.c.singleton.is_(True))
        .values(
            state="active",
            current_engine=BACKEND,
            transition_epoch=sch.transition.c.transition_epoch + case((sch.transition.c.state != "active", 1), else_=0),
            updated_at=func.clock_timestamp(),
        )
    )
    if res.rowcount == 0:
        raise ValidationError("storage_transition_state", None, "transition singleton is missing; reinstall the schema")
