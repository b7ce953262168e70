"""External callbacks: a running attempt parks on a random token and an outside system
resolves it (complete / fail / retry / resume) or it times out.

Registering a callback materialises the attempt's lease (the receipt stays open until the
lease leaves), so everything here works on ``leases`` rows found by ``callback_id``. CEL
expressions (``CallbackConfig``) are not supported: a non-empty expression is a
``ValidationError``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, BindParameter, Connection, Select, and_, bindparam, select, true

from qstore.errors import CallbackNotFoundError, StaleAttemptError, ValidationError
from qstore.schema import StorageSchema
from qstore.schema.queue_plane import at_lane_position
from qstore.storage import destinations, read
from qstore.storage.bodies import Body
from qstore.storage.checks import seconds
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination
from qstore.storage.planes import execution
from qstore.storage.planes.execution import LIVE, Closure
from qstore.storage.statements import AttemptProgress, attempt_progress
from qstore.types import CallbackConfig, CallbackPollKind, CallbackPollResult, JobRow, JobState

__all__ = [
    "RESULT_KEY",
    "callback_job",
    "cancel_callback",
    "check_callback_state",
    "complete_external",
    "enter_callback_wait",
    "fail_external",
    "fail_external_with_error_entry",
    "heartbeat_callback",
    "load_active_lease_in_tx",
    "register_callback",
    "register_callback_with_config",
    "retry_external",
    "wait_for_callback",
]

RESULT_KEY = "_qstore_callback_result"


@dataclass(frozen=True)
class CallbackReads:
    by_token: Select[Any]
    active: Select[Any]
    newest: Select[Any]


@functools.lru_cache(maxsize=64)
def _reads(sch: StorageSchema) -> CallbackReads:
    le, st, r = sch.leases.parent, sch.attempt_state, sch.ready.parent
    job, lease = bindparam("b_job", type_=BigInteger()), bindparam("b_lease", type_=BigInteger())
    token: BindParameter[Any] = bindparam("b_token")
    lp = attempt_progress(sch, "lp", le.c.job_id, le.c.run_lease,
                          None if sch.config.lease_claim_receipts else le.c.lease_slot)
    merged = AttemptProgress(lp, st)
    body_join = at_lane_position(r, le)
    lease_view = (select(le, r.c.kind, r.c.args, r.c.payload, r.c.run_at, r.c.created_at, r.c.unique_key,
                         r.c.unique_states, merged.progress.label("progress"), st.c.callback_filter,
                         st.c.callback_on_complete, st.c.callback_on_fail, st.c.callback_transform,
                         st.c.callback_result, st.c.callback_result.isnot(None).label("has_result"),
                         merged.heartbeat_at.label("state_heartbeat_at"))
                  .select_from(le.join(r, body_join).outerjoin(
                      st, and_(st.c.job_id == le.c.job_id, st.c.run_lease == le.c.run_lease))
                      .outerjoin(lp, true())))
    return CallbackReads(
        by_token=lease_view.where(le.c.callback_id == token, le.c.state.in_(LIVE)).order_by(le.c.run_lease.desc()),
        active=lease_view.where(le.c.job_id == job, le.c.run_lease == lease, le.c.state.in_(LIVE)),
        newest=lease_view.where(le.c.job_id == job).order_by(le.c.run_lease.desc()).limit(1),
    )


def _lease_job_row(x: Any) -> JobRow:
    p = x.payload or {}
    metadata = dict(p.get("metadata") or {})
    if x.has_result:
        metadata[RESULT_KEY] = x.callback_result
    return JobRow(
        id=x.job_id, kind=x.kind, queue=x.queue, args=x.args, state=JobState(x.state),
        priority=x.effective_priority, attempt=x.attempt, run_lease=x.run_lease,
        max_attempts=x.max_attempts, run_at=x.run_at, created_at=x.created_at,
        heartbeat_at=x.state_heartbeat_at or x.heartbeat_at, deadline_at=x.deadline_at,
        attempted_at=x.attempted_at, errors=p.get("errors") or None, metadata=metadata,
        tags=list(p.get("tags") or []), unique_key=x.unique_key, unique_states=x.unique_states,
        callback_id=x.callback_id, callback_timeout_at=x.callback_timeout_at,
        callback_filter=x.callback_filter, callback_on_complete=x.callback_on_complete,
        callback_on_fail=x.callback_on_fail, callback_transform=x.callback_transform,
        progress=x.progress if x.progress is not None else p.get("progress"),
    )


def _check_config(config: CallbackConfig | None) -> None:
    if config is None:
        return
    for name in ("filter", "on_complete", "on_fail", "transform"):
        expr = getattr(config, name)
        if expr is not None and str(expr).strip():
            raise ValidationError(f"callback_config.{name}", expr,
                                  "CEL callback expressions are not supported by qstore")


def register_callback_with_config(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
                                  timeout: timedelta | float, config: CallbackConfig | None) -> uuid.UUID:
    """Materialise the attempt's lease and give it a fresh random token with a timeout (a
    newer registration replaces the token). Raises :class:`~qstore.errors.StaleAttemptError`
    (a ``ValidationError``) when the attempt is not running, and ``ValidationError`` when
    the config carries CEL expressions (unsupported)."""
    _check_config(config)
    sch = ctx.schema
    execution.materialize(conn, sch, job_id, run_lease)
    token = uuid.uuid4()
    if not execution.set_token(conn, sch, job_id, run_lease, token, seconds(timeout)):
        raise StaleAttemptError(job_id, run_lease)
    return token


def register_callback(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
                      timeout: timedelta | float) -> uuid.UUID:
    """``register_callback_with_config`` without CEL expressions."""
    return register_callback_with_config(ctx, conn, job_id, run_lease, timeout, CallbackConfig())


def cancel_callback(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int) -> bool:
    """Clear the running attempt's token; False when it has none (or is stale)."""
    return execution.clear_token(conn, ctx.schema, job_id, run_lease)


def enter_callback_wait(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
                        callback_id: uuid.UUID) -> bool:
    """running -> waiting_external when the token matches (heartbeat/deadline cleared)."""
    return execution.enter_wait(conn, ctx.schema, job_id, run_lease, callback_id)


def wait_for_callback(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
                      timeout: timedelta | float, config: CallbackConfig | None = None,
                      callback_id: uuid.UUID | None = None) -> uuid.UUID | None:
    """Park the running attempt on an external callback, in one transaction: without a
    ``callback_id``, register one first (``register_callback_with_config`` with ``timeout``
    and ``config``); then running -> waiting_external on that token (heartbeat and deadline
    cleared, as ``enter_callback_wait``). Returns the token the attempt now waits on, or
    None, with nothing written, when the attempt is not running (it ended) or holds another
    token. A ``config`` with CEL expressions is a ``ValidationError``."""
    sch = ctx.schema
    token = callback_id
    if token is None:
        _check_config(config)
        execution.materialize(conn, sch, job_id, run_lease)
        token = uuid.uuid4()
        if not execution.set_token(conn, sch, job_id, run_lease, token, seconds(timeout)):
            return None
    return token if execution.enter_wait(conn, sch, job_id, run_lease, token) else None


def load_active_lease_in_tx(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int) -> JobRow | None:
    """The lease-backed attempt (running or waiting), with its callback fields."""
    x = conn.execute(_reads(ctx.schema).active, {"b_job": job_id, "b_lease": run_lease}).first()
    return _lease_job_row(x) if x is not None else None


def callback_job(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID, run_lease: int | None = None,
                 for_update: bool = False) -> JobRow | None:
    """The live attempt holding ``callback_id`` (newest run lease; matching ``run_lease``
    when given), locked when ``for_update``."""
    sch = ctx.schema
    if for_update and execution.lock_by_token(conn, sch, callback_id, run_lease, LIVE) is None:
        return None
    for x in conn.execute(_reads(sch).by_token, {"b_token": callback_id}):
        if run_lease is None or x.run_lease == run_lease:
            return _lease_job_row(x)
    return None


def _resolve(ctx: StorageContext, conn: Connection, token: uuid.UUID, run_lease: int | None, decision: Decision,
             closure: Closure, states: Sequence[JobState] = LIVE, progress_kept: bool = True) -> JobRow:
    """End the attempt holding ``token`` with ``decision``; ``CallbackNotFoundError`` if none."""
    sch = ctx.schema
    pair = execution.lock_by_token(conn, sch, token, run_lease, states)
    taken = execution.take_attempts(conn, sch, [pair], closure, states) if pair else []
    if not taken:
        raise CallbackNotFoundError(token)
    t = taken[0]
    body = Body.from_taken(t) if progress_kept else Body.from_taken(t, None)
    return destinations.apply(conn, ctx, [(body, decision, t.old_state)], ready_payloads={t.job_id: t.payload})[0]


def complete_external(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID, payload: Any = None,
                      run_lease: int | None = None, resume: bool = False) -> JobRow:
    """Resolve the callback: ``resume`` hands ``payload`` back to the same attempt (running
    again); otherwise the job completes. ``CallbackNotFoundError`` if no live attempt holds
    the token."""
    sch = ctx.schema
    if resume:
        pair = execution.lock_by_token(conn, sch, callback_id, run_lease, LIVE)
        if pair is None or not execution.resume(conn, sch, pair, callback_id, payload):
            raise CallbackNotFoundError(callback_id)
        row = load_active_lease_in_tx(ctx, conn, *pair)
        assert row is not None
        return row
    return _resolve(ctx, conn, callback_id, run_lease,
                    Decision(Destination.TERMINAL, JobState.COMPLETED, clear_progress=True), Closure.COMPLETED,
                    progress_kept=False)


def fail_external_with_error_entry(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID,
                                   error_entry: Any, run_lease: int | None = None) -> JobRow:
    """The attempt holding the token ends failed with ``error_entry`` (a non-object is
    wrapped as ``{"error": …}``; attempt, time and ``terminal`` are filled in)."""
    entry = dict(error_entry) if isinstance(error_entry, dict) else {"error": error_entry}
    live = callback_job(ctx, conn, callback_id, run_lease)
    entry.setdefault("attempt", live.attempt if live else 0)
    entry.setdefault("at", destinations.now(conn).isoformat())
    entry.setdefault("terminal", True)
    return _resolve(ctx, conn, callback_id, run_lease,
                    Decision(Destination.TERMINAL, JobState.FAILED, error_obj=entry), Closure.FAILED)


def fail_external(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID, error: str,
                  run_lease: int | None = None) -> JobRow:
    """``fail_external_with_error_entry`` with ``{"error": error}``."""
    return fail_external_with_error_entry(ctx, conn, callback_id, {"error": error}, run_lease)


def retry_external(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID,
                   run_lease: int | None = None) -> JobRow:
    """waiting_external only: re-enqueue with attempt 0 (progress kept)."""
    return _resolve(ctx, conn, callback_id, run_lease, Decision(Destination.READY, attempt=0), Closure.RETRIED,
                    (JobState.WAITING_EXTERNAL,))


def heartbeat_callback(ctx: StorageContext, conn: Connection, callback_id: uuid.UUID,
                       timeout: timedelta | float) -> JobRow:
    """Push the waiting attempt's callback timeout ``timeout`` from now; returns the job.
    ``CallbackNotFoundError`` if no waiting attempt holds the token."""
    job_id = execution.extend(conn, ctx.schema, callback_id, seconds(timeout))
    if job_id is None:
        raise CallbackNotFoundError(callback_id)
    row = read.load_job(ctx, conn, job_id)
    assert row is not None
    return row


def check_callback_state(ctx: StorageContext, conn: Connection, job_id: int,
                         callback_id: uuid.UUID) -> CallbackPollResult:
    """Where the attempt waiting on ``callback_id`` stands: resolved (the result is handed
    over once), pending, stale (another token), an unexpected state, or not found."""
    sch = ctx.schema
    x = conn.execute(_reads(sch).newest, {"b_job": job_id}).first()
    if x is None:
        row = read.load_job(ctx, conn, job_id)
        if row is None:
            return CallbackPollResult(CallbackPollKind.NOT_FOUND)
        return CallbackPollResult(CallbackPollKind.UNEXPECTED_STATE, token=callback_id, state=row.state)
    state = JobState(x.state)
    if state == JobState.RUNNING and x.callback_id is None and x.has_result:
        execution.consume_result(conn, sch, x.job_id, x.run_lease)
        return CallbackPollResult(CallbackPollKind.RESOLVED, payload=x.callback_result)
    if x.callback_id != callback_id:
        return CallbackPollResult(CallbackPollKind.STALE, token=callback_id, current=x.callback_id, state=state)
    if state == JobState.WAITING_EXTERNAL:
        return CallbackPollResult(CallbackPollKind.PENDING, token=callback_id, state=state)
    return CallbackPollResult(CallbackPollKind.UNEXPECTED_STATE, token=callback_id, state=state)
