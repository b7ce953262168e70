"""Upkeep that moves work along: rescue of stale / overdue / timed-out attempts, and
promotion of due deferred jobs.

Rescue closes the old attempt first (closure + lease delete by ``(job_id, run_lease)``),
so a late write from the rescued worker is stale; it respects exhaustion: an exhausted
attempt ends failed — or in the DLQ when its queue's policy says so — instead of looping.
These automatic paths never stall on a unique-key conflict: a job that would take a key
another job owns ends failed, naming the owner, and the others go on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Integer, Select, and_, bindparam, func, select, true
from sqlalchemy.dialects.postgresql import INTERVAL

from qstore.schema import StorageSchema
from qstore.storage import destinations
from qstore.storage.bodies import Body
from qstore.storage.checks import seconds
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination, exhausted, rescue_decision
from qstore.storage.destinations import UniqueConflicts
from qstore.storage.planes import execution, queue
from qstore.storage.planes.execution import Closure
from qstore.storage.statements import (
    AttemptProgress,
    attempt_leased,
    attempt_progress,
    receipt_open,
)
from qstore.storage.targets import Runner, Transactions
from qstore.types import JobRow, JobState

__all__ = ["PROMOTABLE", "RESCUE_LIMIT", "any_due", "promote_all_due", "promote_due", "rescue_expired_callbacks",
           "rescue_expired_deadlines", "rescue_stale_heartbeats"]

RESCUE_LIMIT = 500


@dataclass(frozen=True)
class RescueStatements:
    stale_leases: Select[Any]
    stale_claims: Select[Any]
    overdue_leases: Select[Any]
    overdue_claims: Select[Any]
    timed_out: Select[Any]


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> RescueStatements:
    c, le, st = sch.claims.parent, sch.leases.parent, sch.attempt_state
    # the statement's start, a stable value: the deadline and timeout bounds below are then
    # index conditions (a volatile clock_timestamp() would make them filters over every row)
    now = func.statement_timestamp()
    cutoff = now - bindparam("staleness", type_=INTERVAL())
    is_open = receipt_open(sch, c)
    leased = attempt_leased(le, c)
    st_c = st.alias("st_c")
    st_l = st.alias("st_l")
    # the effective heartbeat: the latest progress row's or attempt_state's (see AttemptProgress)
    lp = attempt_progress(sch, "lp", le.c.job_id, le.c.run_lease,
                          None if sch.config.lease_claim_receipts else le.c.lease_slot)
    cp = attempt_progress(sch, "cp", c.c.job_id, c.c.run_lease, c.c.claim_slot)
    lease_beat, claim_beat = AttemptProgress(lp, st_l).heartbeat_at, AttemptProgress(cp, st_c).heartbeat_at
    limit = bindparam("limit", type_=Integer())
    return RescueStatements(
        stale_leases=select(le.c.job_id, le.c.run_lease).select_from(
            le.outerjoin(st_l, and_(st_l.c.job_id == le.c.job_id, st_l.c.run_lease == le.c.run_lease))
            .outerjoin(lp, true()))
        .where(le.c.state == JobState.RUNNING,
               func.coalesce(lease_beat, le.c.heartbeat_at, le.c.attempted_at) < cutoff)
        .limit(limit).with_for_update(of=le, skip_locked=True),
        stale_claims=select(c.c.job_id, c.c.run_lease).select_from(
            c.outerjoin(st_c, and_(st_c.c.job_id == c.c.job_id, st_c.c.run_lease == c.c.run_lease))
            .outerjoin(cp, true()))
        .where(is_open, ~leased, func.coalesce(claim_beat, c.c.claimed_at) < cutoff)
        .limit(limit).with_for_update(of=c, skip_locked=True),
        overdue_leases=select(le.c.job_id, le.c.run_lease).where(le.c.state == JobState.RUNNING, le.c.deadline_at < now)
        .limit(limit).with_for_update(skip_locked=True),
        overdue_claims=select(c.c.job_id, c.c.run_lease).where(is_open, ~leased, c.c.deadline_at < now)
        .limit(limit).with_for_update(of=c, skip_locked=True),
        timed_out=select(le.c.job_id, le.c.run_lease).where(
            le.c.state == JobState.WAITING_EXTERNAL, le.c.callback_timeout_at < now)
        .limit(limit).with_for_update(skip_locked=True),
    )


def _rescue(ctx: StorageContext, conn: Connection, pairs: Sequence[tuple[int, int]], closure: Closure,
            error: str, lease_states: Sequence[JobState] = (JobState.RUNNING,)) -> list[JobRow]:
    taken = execution.take_attempts(conn, ctx.schema, pairs, closure, lease_states)
    if not taken:
        return []
    bodies = [Body.from_taken(t) for t in taken]
    dlq_on = destinations.dlq_queues(conn, ctx.schema, [b for b in bodies if exhausted(b)])
    items = [(b, rescue_decision(b, dlq_on=destinations.logical(b) in dlq_on, label=closure.value, error=error),
              t.old_state) for t, b in zip(taken, bodies, strict=True)]
    return destinations.apply(conn, ctx, items, ready_payloads={t.job_id: t.payload for t in taken},
                              unique_conflicts=UniqueConflicts.FAIL_JOB)


def _pairs(conn: Connection, stmt: Select[Any], params: dict[str, Any]) -> list[tuple[int, int]]:
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


def rescue_stale_heartbeats(ctx: StorageContext, conn: Connection, staleness: timedelta | float) -> list[JobRow]:
    """Running attempts silent for ``staleness`` (effective heartbeat: attempt state, lease,
    else claim time) end: retryable after backoff, or failed / DLQ when exhausted. At most
    ``RESCUE_LIMIT`` leases and as many receipts per call; rows locked by others are
    skipped."""
    s = _statements(ctx.schema)
    arg: dict[str, Any] = {"limit": RESCUE_LIMIT, "staleness": seconds(staleness)}
    leases = _pairs(conn, s.stale_leases, arg)
    claims = _pairs(conn, s.stale_claims, arg)
    return (_rescue(ctx, conn, leases, Closure.RESCUED, "heartbeat stale")
            + _rescue(ctx, conn, claims, Closure.RESCUED, "receipt claim stale"))


def rescue_expired_deadlines(ctx: StorageContext, conn: Connection) -> list[JobRow]:
    """Running attempts past their ``deadline_at`` end as in stale rescue."""
    s = _statements(ctx.schema)
    arg = {"limit": RESCUE_LIMIT}
    pairs = _pairs(conn, s.overdue_leases, arg) + _pairs(conn, s.overdue_claims, arg)
    return _rescue(ctx, conn, pairs, Closure.DEADLINE_EXPIRED, "hard deadline exceeded")


def rescue_expired_callbacks(ctx: StorageContext, conn: Connection) -> list[JobRow]:
    """Attempts waiting past their ``callback_timeout_at`` end as in stale rescue."""
    pairs = _pairs(conn, _statements(ctx.schema).timed_out, {"limit": RESCUE_LIMIT})
    return _rescue(ctx, conn, pairs, Closure.CALLBACK_TIMEOUT, "callback timed out", (JobState.WAITING_EXTERNAL,))


def any_due(run: Runner, sch: StorageSchema, state: JobState) -> bool:
    """Whether a promotion of ``state`` would find anything now: a live wheel entry or an
    overflow row of an unpaused queue whose ``run_at`` has come (what ``take_due`` takes,
    without its order, lock or writes). One statement without parameters, read through
    the due indexes and prepared on its connection, so the server plans it (over every
    wheel and marks child) once per connection rather than at every pass."""
    return bool(run.rows(queue.deferred_statements(sch).due_probes[state.value], {})[0][0])


PROMOTABLE = (JobState.SCHEDULED, JobState.RETRYABLE)


def promote_due(ctx: StorageContext, tx: Transactions, state: JobState | str, batch_size: int) -> int:
    """Move up to ``batch_size`` due deferred rows of ``state`` (scheduled or retryable; any
    other state, or a ``batch_size`` of 0 or less, moves nothing) of unpaused queues into the
    ready ring, attempt and run_lease kept; NOTIFY on commit. Returns how many became
    available.

    A job whose unique key another job took meanwhile (its ``unique_states`` released the
    key while it waited) does not become available: it ends ``failed`` with an error entry
    naming the key's owner, and the rest of the batch is promoted (two due jobs of one
    batch wanting the same key: the first in promotion order wins).

    A pass that finds nothing due costs one statement (:func:`any_due`; autocommitted on an
    Engine, so no BEGIN or COMMIT either); only when something is due does the promotion
    itself run, in a transaction of its own on an Engine and in a SAVEPOINT of the
    caller's transaction otherwise."""
    st = JobState(state)
    if st not in PROMOTABLE:
        return 0
    return _promote(ctx, tx, (st,), batch_size)[st]


def promote_all_due(ctx: StorageContext, tx: Transactions, batch_size: int) -> dict[JobState, int]:
    """:func:`promote_due` for both deferred states at once: the ``batch_size`` due waits
    due first across the two states (by ``run_at``, then priority and job id), taken and
    promoted in one transaction in that order. Returns how many of each state became
    available.

    One transaction decides every unique-key contest among the waits it takes: a job due
    earlier meets its key before a job due later takes it, whatever their states, and no
    job of the pass can be claimed (and end, releasing its key) before the others are
    decided. Two separate passes would let a late promotion make the later-due job
    available first and a worker end it before the earlier one is promoted. The order holds
    across calls too: a call takes nothing due after a wait it leaves (when both states
    have something due, it first reads the key of the ``batch_size``-th wait due, and each
    state is taken up to it). Waits another transaction holds (a cancel, say) are skipped,
    and a wait that comes due while the call runs may be taken or left.

    A pass that finds nothing due costs two statements (one probe per state)."""
    return _promote(ctx, tx, PROMOTABLE, batch_size)


def _promote(ctx: StorageContext, tx: Transactions, states: Sequence[JobState],
             batch_size: int) -> dict[JobState, int]:
    moved = dict.fromkeys(states, 0)
    if batch_size <= 0:
        return moved
    with tx.hot() as run:
        due = [st for st in states if any_due(run, ctx.schema, st)]
    if not due:
        return moved
    with tx.atomic() as conn:
        upto = queue.due_bound(conn, ctx.schema, batch_size) if len(due) > 1 else queue.NO_DUE_BOUND
        taken = [(r, st) for st in due for r in queue.take_due(conn, ctx.schema, st, batch_size, upto)]
        if not taken:
            return moved
        taken.sort(key=lambda t: (t[0].run_at, t[0].priority, t[0].job_id))  # RETURNING keeps no order
        out = destinations.apply(conn, ctx, [(Body.from_snapshot(r), Decision(Destination.READY), st)
                                             for r, st in taken], unique_conflicts=UniqueConflicts.FAIL_JOB)
    for row, (_, st) in zip(out, taken, strict=True):
        if row.state == JobState.AVAILABLE:
            moved[st] += 1
    return moved
