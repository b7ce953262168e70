"""Execution plane: the only Python writer of leases, claim receipts and closures, the
attempts' heartbeats and progress (``attempt_progress``) and their callback state
(``attempt_state``).

Every way of ending an attempt (complete, retry, snooze, cancel, fail, DLQ, rescue, callback
resolution) goes through :func:`take_attempts`. Order of locks: claim rows (``FOR UPDATE``,
sorted by claim slot, job and run lease) → leases → closures. A materialised lease is found
and deleted by ``(job_id, run_lease)``; every lease deletion closes the attempt's receipt in
the same transaction, and a receipt is closed without a lease only when no lease exists for
the attempt. Finishing an
attempt is at-most-once: every closer (this module and the server's ``complete_receipts``)
locks the receipt first and checks, in a later statement that therefore sees every closure
committed before the lock was granted, that no closure of either form (a
``lease_claim_closures`` row, or a member of a ``lease_claim_closure_batches`` row) names
the attempt; the narrow closure's primary key guards narrow closers besides. Anything stale
is simply not returned.

A heartbeat or progress report appends one ``attempt_progress`` row in the ring slot that
holds its attempt (the receipt's claim slot, or the lease's slot on a receipts-off install):
no row is updated or deleted, and the slot is reclaimed by ``TRUNCATE`` once the ring's prune
gate finds no live attempt in it. A heartbeat locks the receipt but never writes it, so
a heartbeated attempt still completes on the fast path (a completion drops the attempt's
progress on either path). Mutable per-attempt state (``attempt_state``) is created only
when a callback hands a result back to its attempt (``resume``).
"""

from __future__ import annotations

import enum
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    BindParameter,
    Connection,
    Insert,
    Integer,
    Select,
    SmallInteger,
    Text,
    and_,
    bindparam,
    delete,
    func,
    literal,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import INTERVAL, JSONB, distinct_on
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.dml import Insert as PgInsert
from sqlalchemy.sql.dml import ReturningDelete, Update

from qstore.errors import InvariantError, IsolationLevelError
from qstore.schema import StorageSchema
from qstore.schema.queue_plane import at_lane_position
from qstore.storage.bodies import Body, ReadyKey, Taken
from qstore.storage.columns import payload_fields
from qstore.storage.statements import attempt_leased, closed_in_batch, receipt_open, unnest_rows
from qstore.types import JobRow, JobState

__all__ = ["Closure", "ExecutionStatements", "statements", "take_attempts"]

PAIR = {"job_id": BigInteger(), "run_lease": BigInteger()}
#: The states of a live attempt's lease.
LIVE = (JobState.RUNNING, JobState.WAITING_EXTERNAL)


class Closure(str, enum.Enum):
    """Labels written to ``lease_claim_closures.outcome`` (informational: only a closure's
    existence matters)."""

    COMPLETED = "completed"
    RETRYABLE = "retryable"
    SCHEDULED = "scheduled"
    CANCELLED = "cancelled"
    FAILED = "failed"
    DLQ = "dlq"
    RESCUED = "rescued"
    DEADLINE_EXPIRED = "deadline_expired"
    CALLBACK_TIMEOUT = "callback_timeout"
    RETRIED = "retried"


@dataclass(frozen=True)
class ExecutionStatements:
    """The execution plane's statements for one install, built once."""

    lock_claims: Select[Any]
    delete_leases: ReturningDelete[Any]
    close: Insert
    bodies: Select[Any]
    drop_state: ReturningDelete[Any]
    latest_progress: Select[Any]
    hb_lock: Select[Any]
    hb_open: Select[Any]
    hb_leased: Select[Any]
    cb_lock_claim: Select[Any]
    cb_insert_lease: Insert
    cb_mark_materialized: Update
    cb_set_token: Update
    cb_clear_token: Update
    cb_enter_wait: Update
    cb_locked_by_token: Select[Any]
    cb_resume: Update
    cb_extend: Update
    cb_store_result: PgInsert
    cb_consume_result: Update
    cb_clear_cel: Update


@functools.lru_cache(maxsize=64)
def statements(sch: StorageSchema) -> ExecutionStatements:
    c, le, cl = sch.claims.parent, sch.leases.parent, sch.closures.parent
    r, st, lrs = sch.ready.parent, sch.attempt_state, sch.lease_ring.state
    ap = sch.progress.parent
    p = unnest_rows("p", **PAIR)
    on_pair = lambda t: and_(t.c.job_id == p.c.job_id, t.c.run_lease == p.c.run_lease)  # noqa: E731
    no_lease = ~select(le.c.job_id).where(le.c.job_id == c.c.job_id, le.c.run_lease == c.c.run_lease).exists()
    k = unnest_rows("k", ready_slot=Integer(), queue=Text(), priority=SmallInteger(),
                    enqueue_shard=SmallInteger(), lane_seq=BigInteger())
    hp = unnest_rows("p", job_id=BigInteger(), run_lease=BigInteger(), progress=JSONB())
    on_c = and_(c.c.job_id == hp.c.job_id, c.c.run_lease == hp.c.run_lease)
    is_open = receipt_open(sch, c)
    # a batch closure (the fast path's) beside the narrow closure's key: checked by the
    # statement after lock_claims, so it sees every closure committed before the lock
    in_batch = closed_in_batch(sch.closure_batches.parent, c.c.claim_slot, c.c.job_id, c.c.run_lease)
    has_lease = attempt_leased(le, c)
    now = func.clock_timestamp()
    # the transaction's isolation, read with the locks (see ended_in_read_committed)
    isolation = func.current_setting("transaction_isolation", type_=Text()).label("isolation")
    job, lease = bindparam("b_job", type_=BigInteger()), bindparam("b_lease", type_=BigInteger())
    token: BindParameter[Any] = bindparam("b_token")
    lease_cols = ["lease_slot", "lease_generation", "ready_slot", "ready_generation", "job_id", "queue",
                  "state", "priority", "effective_priority", "attempt", "run_lease", "max_attempts",
                  "lane_seq", "enqueue_shard", "claim_slot", "heartbeat_at", "deadline_at", "attempted_at"]
    return ExecutionStatements(
        # receipts are locked in (claim slot, job, run lease) order, the order complete_receipts
        # takes them in (slot by slot), so no two closers wait on each other across slots
        lock_claims=select(c, isolation).select_from(c.join(p, on_pair(c)))
        .order_by(c.c.claim_slot, c.c.job_id, c.c.run_lease).with_for_update(of=c),
        delete_leases=delete(le).where(on_pair(le), le.c.state.in_(bindparam("states", expanding=True)))
        .returning(*le.c),
        close=pg_insert(cl).from_select(
            ["claim_slot", "job_id", "run_lease", "outcome"],
            select(c.c.claim_slot, c.c.job_id, c.c.run_lease, bindparam("outcome", type_=Text()))
            .select_from(c.join(p, on_pair(c))).where(no_lease, ~in_batch),
        ).on_conflict_do_nothing().returning(cl.c.job_id, cl.c.run_lease),
        bodies=select(r).select_from(r.join(k, at_lane_position(r, k))),
        drop_state=delete(st).where(on_pair(st)).returning(st.c.job_id, st.c.run_lease, st.c.progress,
                                                           st.c.heartbeat_at),
        # the latest progress row of each attempt (greatest seq first per pair)
        latest_progress=select(ap.c.job_id, ap.c.run_lease, ap.c.progress).select_from(ap.join(p, on_pair(ap)))
        .order_by(ap.c.job_id, ap.c.run_lease, ap.c.seq.desc()).ext(distinct_on(ap.c.job_id, ap.c.run_lease)),
        # lock open receipts first, so the later statements see every committed closure
        hb_lock=select(c.c.claim_slot, c.c.job_id, c.c.run_lease)
        .select_from(c.join(hp, on_c)).where(is_open).order_by(c.c.claim_slot, c.c.job_id, c.c.run_lease)
        .with_for_update(of=c),
        hb_open=select(c.c.job_id, c.c.run_lease).select_from(c.join(hp, on_c)).where(is_open),
        # Shared key lock on the leases, after the receipts (the order take_attempts locks
        # them in): a transaction ending the attempt deletes its lease, so the heartbeat waits
        # for it and then finds the lease gone; updates of the lease's other columns
        # (callback token, wait state) and other heartbeats are not held up.
        hb_leased=select(le.c.job_id, le.c.run_lease, le.c.lease_slot).select_from(
            le.join(hp, and_(le.c.job_id == hp.c.job_id, le.c.run_lease == hp.c.run_lease)))
        .where(le.c.state.in_(bindparam("states", expanding=True)))
        .order_by(le.c.job_id, le.c.run_lease).with_for_update(of=le, read=True, key_share=True),
        cb_lock_claim=select(c, isolation).where(c.c.job_id == job, c.c.run_lease == lease).with_for_update(),
        cb_insert_lease=pg_insert(le).from_select(lease_cols, select(
            lrs.c.current_slot, lrs.c.generation, c.c.ready_slot, c.c.ready_generation, c.c.job_id,
            c.c.queue, literal(JobState.RUNNING.value).cast(le.c.state.type), c.c.priority, c.c.effective_priority,
            c.c.attempt, c.c.run_lease, c.c.max_attempts, c.c.lane_seq, c.c.enqueue_shard, c.c.claim_slot,
            now, c.c.deadline_at, c.c.claimed_at,
        ).select_from(c.join(lrs, literal(True))).where(
            c.c.job_id == job, c.c.run_lease == lease, is_open, ~has_lease)),
        cb_mark_materialized=update(c).where(c.c.job_id == job, c.c.run_lease == lease,
                                             c.c.materialized_at.is_(None)).values(materialized_at=now),
        cb_set_token=update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.state == JobState.RUNNING)
        .values(callback_id=token, callback_timeout_at=now + bindparam("timeout", type_=INTERVAL()))
        .returning(le.c.job_id),
        cb_clear_token=update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.state == JobState.RUNNING,
                                        le.c.callback_id.isnot(None))
        .values(callback_id=None, callback_timeout_at=None).returning(le.c.job_id),
        cb_enter_wait=update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.callback_id == token,
                                       le.c.state == JobState.RUNNING)
        .values(state=JobState.WAITING_EXTERNAL, heartbeat_at=None, deadline_at=None).returning(le.c.job_id),
        cb_locked_by_token=select(le.c.job_id, le.c.run_lease, le.c.state).where(
            le.c.callback_id == token, le.c.state.in_(bindparam("states", expanding=True)))
        .order_by(le.c.run_lease.desc()).with_for_update(),
        cb_resume=update(le).where(le.c.callback_id == token, le.c.state.in_(LIVE),
                                   le.c.job_id == job, le.c.run_lease == lease)
        .values(state=JobState.RUNNING, callback_id=None, callback_timeout_at=None, heartbeat_at=now)
        .returning(le.c.job_id, le.c.run_lease),
        cb_extend=update(le).where(le.c.callback_id == token, le.c.state == JobState.WAITING_EXTERNAL)
        .values(callback_timeout_at=now + bindparam("timeout", type_=INTERVAL()))
        .returning(le.c.job_id),
        cb_store_result=pg_insert(st).values(job_id=job, run_lease=lease,
                                             callback_result=bindparam("result", type_=JSONB(none_as_null=False)),
                                             updated_at=now),
        # SQL NULL, not JSON null: a consumed result must read as absent
        cb_consume_result=update(st).where(st.c.job_id == job, st.c.run_lease == lease)
        .values(callback_result=null(), updated_at=now),
        cb_clear_cel=update(st).where(st.c.job_id == job, st.c.run_lease == lease).values(
            callback_filter=None, callback_on_complete=None, callback_on_fail=None, callback_transform=None),
    )


# -- taking attempts out of running -------------------------------------------------------------
def ended_in_read_committed(locked: Any) -> None:
    """Raise :class:`~qstore.errors.IsolationLevelError` unless the receipts just locked
    (rows of ``lock_claims`` or ``cb_lock_claim``, which carry the transaction's isolation)
    were locked in READ COMMITTED: the statements after the lock must see every closure
    committed while it was awaited, and only READ COMMITTED takes a new snapshot per
    statement. Every row carries the same value, so the first is read; nothing has been
    written when it raises."""
    first = next(iter(locked), None)
    if first is not None and first.isolation != "read committed":
        raise IsolationLevelError(first.isolation)


def take_attempts(conn: Connection, sch: StorageSchema, pairs: Sequence[tuple[int, int]], outcome: Closure,
                  lease_states: Sequence[JobState] = (JobState.RUNNING,)) -> list[Taken]:
    """End the live attempts among ``pairs`` (others are stale and skipped): close each
    receipt with ``outcome``, delete leases and attempt state; returns the hydrated
    attempts in input order. Runs on ``conn``'s transaction."""
    pairs = list(dict.fromkeys((int(j), int(r)) for j, r in pairs))
    if not pairs:
        return []
    s = statements(sch)
    arg = {"job_id": [j for j, _ in pairs], "run_lease": [r for _, r in pairs]}
    claims = {(row.job_id, row.run_lease): row for row in conn.execute(s.lock_claims, arg)}
    ended_in_read_committed(claims.values())
    leases = {(row.job_id, row.run_lease): row
              for row in conn.execute(s.delete_leases, {**arg, "states": list(lease_states)})}
    closed: set[tuple[int, int]] = set()
    if claims:
        closed = {(row[0], row[1]) for row in conn.execute(s.close, {**arg, "outcome": outcome.value})}
    taken_keys = [pr for pr in pairs if pr in leases or pr in closed]
    if not taken_keys:
        return []
    refs = {pr: (leases.get(pr) or claims[pr]) for pr in taken_keys}
    bodies = {
        (b.ready_slot, b.queue, b.priority, b.enqueue_shard, b.lane_seq): b
        for b in conn.execute(s.bodies, {
            "ready_slot": [x.ready_slot for x in refs.values()],
            "queue": [x.queue for x in refs.values()],
            "priority": [x.priority for x in refs.values()],
            "enqueue_shard": [x.enqueue_shard for x in refs.values()],
            "lane_seq": [x.lane_seq for x in refs.values()],
        })
    }
    taken_arg = {"job_id": [j for j, _ in taken_keys], "run_lease": [r for _, r in taken_keys]}
    state = {(row.job_id, row.run_lease): row for row in conn.execute(s.drop_state, taken_arg)}
    reported = {(row.job_id, row.run_lease): row.progress for row in conn.execute(s.latest_progress, taken_arg)}
    out = []
    for pr in taken_keys:
        ref = refs[pr]
        body = bodies.get((ref.ready_slot, ref.queue, ref.priority, ref.enqueue_shard, ref.lane_seq))
        if body is None:  # cannot happen while the ready row is retained (the prune gates)
            raise InvariantError(f"the ready body of job {pr[0]} is missing while its attempt is live")
        lease = leases.get(pr)
        st = state.get(pr)
        # attempt_state's progress (a previous release's report) first, as readers merge them
        progress = st.progress if st is not None and st.progress is not None else reported.get(pr)
        job = JobRow(
            id=pr[0], kind=body.kind, queue=ref.queue, args=body.args,
            state=JobState(lease.state) if lease is not None else JobState.RUNNING,
            priority=ref.priority, attempt=ref.attempt, run_lease=pr[1], max_attempts=ref.max_attempts,
            run_at=body.run_at, created_at=body.created_at,
            attempted_at=lease.attempted_at if lease is not None else ref.claimed_at,
            unique_key=body.unique_key, unique_states=body.unique_states,
            # the attempt's progress, not the one the ready row was written with
            **{**payload_fields(body.payload), "progress": progress},
        )
        ready = ReadyKey(ref.ready_slot, ref.ready_generation, ref.enqueue_shard, ref.lane_seq)
        out.append(Taken(Body(job, ready), body.payload))
    return out


# -- heartbeats and progress ----------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _append(sch: StorageSchema, with_heartbeat: bool, with_progress: bool) -> Insert:
    """``INSERT … SELECT`` of one ``attempt_progress`` row per attempt of the bound arrays
    (``ring_slot, job_id, run_lease, progress``): the heartbeat time and/or the progress
    given, the other carried over from the attempt's latest row in the same slot."""
    ap = sch.progress.parent
    rows = unnest_rows("p", ring_slot=Integer(), job_id=BigInteger(), run_lease=BigInteger(), progress=JSONB())
    prev = (select(ap.c.heartbeat_at, ap.c.progress)
            .where(ap.c.ring_slot == rows.c.ring_slot, ap.c.job_id == rows.c.job_id,
                   ap.c.run_lease == rows.c.run_lease)
            .order_by(ap.c.seq.desc()).limit(1).lateral("prev"))
    at = select(func.clock_timestamp().label("at")).subquery("at")
    return pg_insert(ap).from_select(
        ["ring_slot", "job_id", "run_lease", "seq", "written_at", "heartbeat_at", "progress"],
        select(rows.c.ring_slot, rows.c.job_id, rows.c.run_lease, sch.progress_seq.next_value(),
               at.c.at, at.c.at if with_heartbeat else prev.c.heartbeat_at,
               rows.c.progress if with_progress else prev.c.progress)
        .select_from(rows.join(at, true()).outerjoin(prev, true()))
        .order_by(rows.c.job_id, rows.c.run_lease),
    )


def _append_progress(conn: Connection, sch: StorageSchema, rows: Sequence[tuple[int, int, int, Any]],
                     *, heartbeat: bool, progress: bool) -> None:
    """Append a progress row for each ``(ring_slot, job_id, run_lease, progress)``."""
    conn.execute(_append(sch, heartbeat, progress), {
        "ring_slot": [r[0] for r in rows], "job_id": [r[1] for r in rows],
        "run_lease": [r[2] for r in rows], "progress": [r[3] for r in rows]})


def heartbeat(conn: Connection, sch: StorageSchema, items: Sequence[tuple[int, int, Any]], *,
              with_heartbeat: bool, with_progress: bool, lease_states: Sequence[JobState] = (JobState.RUNNING,)) -> int:
    """Record heartbeats and/or progress for the live attempts among ``items``
    (``(job_id, run_lease, progress)``); returns how many were live.

    An attempt is live when its receipt is open or its lease is in ``lease_states``, read
    under locks: the receipts ``FOR UPDATE`` and the leases ``FOR KEY SHARE``, so a
    transaction that is ending the attempt (it locks the receipt and deletes the lease) is
    waited for, and an attempt it ended is not written to. Rows are locked and written in
    ``(job_id, run_lease)`` order whatever the order of ``items``, so two heartbeats of the
    same attempts never wait on each other in a cycle. Nothing is updated: the receipt is
    only locked, and the attempt gets one appended ``attempt_progress`` row."""
    items = sorted({(int(j), int(r)): (int(j), int(r), pg) for j, r, pg in items}.values(),
                   key=lambda i: (i[0], i[1]))
    if not items:
        return 0
    s = statements(sch)
    arg = {"job_id": [i[0] for i in items], "run_lease": [i[1] for i in items],
           "progress": [i[2] for i in items]}
    locked = conn.execute(s.hb_lock, arg).all()
    leased = {(r[0], r[1]): r.lease_slot for r in conn.execute(s.hb_leased, {**arg, "states": list(lease_states)})}
    open_now = {(r[0], r[1]) for r in conn.execute(s.hb_open, arg)} if locked else set()
    # receipts-off installs have no claims: the lease alone identifies the live attempt
    live = [i for i in items if (i[0], i[1]) in open_now or (i[0], i[1]) in leased]
    if not live:
        return 0
    # The row goes to the slot that holds the attempt, read under the locks above: the
    # receipt's claim slot (a receipt stays open while its attempt lives, lease or not), or
    # the lease's slot on a receipts-off install. The ring's prune gate keeps that slot
    # while the attempt lives.
    if sch.config.lease_claim_receipts:
        slot_of = {(r.job_id, r.run_lease): r.claim_slot for r in locked if (r.job_id, r.run_lease) in open_now}
    else:
        slot_of = leased
    rows = [(slot_of[(j, r)], j, r, pg) for j, r, pg in live if (j, r) in slot_of]
    if rows:
        _append_progress(conn, sch, rows, heartbeat=with_heartbeat, progress=with_progress)
    return len(live)


# -- callback tokens --------------------------------------------------------------------------------
def materialize(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> None:
    """Give an open receipt a lease row (claim row locked first; no-op if already leased,
    closed or absent). The receipt stays open until the lease leaves."""
    s = statements(sch)
    arg = {"b_job": job_id, "b_lease": run_lease}
    locked = conn.execute(s.cb_lock_claim, arg).first()
    if locked is None:
        return
    ended_in_read_committed([locked])
    if conn.execute(s.cb_insert_lease, arg).rowcount:
        conn.execute(s.cb_mark_materialized, arg)


def set_token(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int, token: uuid.UUID,
              timeout: timedelta) -> bool:
    """Give the running lease ``token`` with a timeout; False when it is not running."""
    arg = {"b_job": job_id, "b_lease": run_lease}
    if conn.execute(statements(sch).cb_set_token, {**arg, "b_token": token, "timeout": timeout}).first() is None:
        return False
    clear_cel(conn, sch, job_id, run_lease)
    return True


def clear_token(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> bool:
    arg = {"b_job": job_id, "b_lease": run_lease}
    done = conn.execute(statements(sch).cb_clear_token, arg).first() is not None
    if done:
        clear_cel(conn, sch, job_id, run_lease)
    return done


def clear_cel(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> None:
    conn.execute(statements(sch).cb_clear_cel, {"b_job": job_id, "b_lease": run_lease})


def enter_wait(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int, token: uuid.UUID) -> bool:
    return conn.execute(statements(sch).cb_enter_wait, {
        "b_job": job_id, "b_lease": run_lease, "b_token": token}).first() is not None


def lock_by_token(conn: Connection, sch: StorageSchema, token: uuid.UUID, run_lease: int | None,
                  states: Sequence[JobState]) -> tuple[int, int] | None:
    """Lock the newest lease holding ``token`` in one of ``states`` (matching ``run_lease``
    when given); its ``(job_id, run_lease)`` or None."""
    for r in conn.execute(statements(sch).cb_locked_by_token, {"b_token": token, "states": list(states)}):
        if run_lease is None or r.run_lease == run_lease:
            return (r.job_id, r.run_lease)
    return None


def resume(conn: Connection, sch: StorageSchema, pair: tuple[int, int], token: uuid.UUID, payload: Any) -> bool:
    """Hand ``payload`` back to the attempt holding ``token``: waiting/running → running,
    token cleared, the result stored for the handler. False when the token moved on."""
    s = statements(sch)
    arg = {"b_job": pair[0], "b_lease": pair[1]}
    if conn.execute(s.cb_resume, {**arg, "b_token": token}).first() is None:
        return False
    st = sch.attempt_state
    stmt = s.cb_store_result
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[st.c.job_id, st.c.run_lease],
        set_={"callback_result": stmt.excluded.callback_result, "updated_at": stmt.excluded.updated_at},
    ), {**arg, "result": payload})
    clear_cel(conn, sch, *pair)
    return True


def extend(conn: Connection, sch: StorageSchema, token: uuid.UUID, timeout: timedelta) -> int | None:
    """Push the waiting attempt's callback timeout ``timeout`` from now; its job id or None."""
    row = conn.execute(statements(sch).cb_extend, {"b_token": token, "timeout": timeout}).first()
    return int(row.job_id) if row is not None else None


def consume_result(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> None:
    conn.execute(statements(sch).cb_consume_result, {"b_job": job_id, "b_lease": run_lease})
