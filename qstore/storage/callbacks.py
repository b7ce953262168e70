"""External callbacks: a running attempt parks on a random token and an outside system
resolves it (complete / fail / retry / resume) or it times out.

Registering a callback materialises the attempt's lease (the receipt stays open until the
lease leaves), so everything here works on ``leases`` rows found by ``callback_id``.
CEL expressions (``CallbackConfig``) are not supported: a non-empty expression is a
``ValidationError``.
"""

from __future__ import annotations

import functools
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    BindParameter,
    Connection,
    and_,
    bindparam,
    func,
    literal,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import INTERVAL, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.errors import CallbackNotFoundError, ValidationError
from qstore.model import CallbackConfig, CallbackPollResult, JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage.attempts import take_attempts
from qstore.storage.enqueue import LaneRouter
from qstore.storage.statements import attempt_leased, receipt_closed
from qstore.storage.transitions import Decision, apply
from qstore.storage.writers import Body

__all__ = [
    "callback_job", "cancel_callback", "check_callback_state", "enter_wait", "heartbeat_callback",
    "load_active_lease", "materialize", "register", "resolve", "resume",
]

LIVE = ("running", "waiting_external")
RESULT_KEY = "_qstore_callback_result"


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    c, cl, le, st = sch.claims.parent, sch.closures.parent, sch.leases.parent, sch.attempt_state
    r, lrs = sch.ready.parent, sch.lease_ring.state
    job, lease = bindparam("b_job", type_=BigInteger()), bindparam("b_lease", type_=BigInteger())
    now = func.clock_timestamp()
    closed = receipt_closed(cl, c)
    has_lease = attempt_leased(le, c)
    lease_cols = ["lease_slot", "lease_generation", "ready_slot", "ready_generation", "job_id", "queue",
                  "state", "priority", "effective_priority", "attempt", "run_lease", "max_attempts",
                  "lane_seq", "enqueue_shard", "claim_slot", "heartbeat_at", "deadline_at", "attempted_at"]
    body_join = and_(r.c.ready_slot == le.c.ready_slot, r.c.queue == le.c.queue, r.c.priority == le.c.priority,
                     r.c.enqueue_shard == le.c.enqueue_shard, r.c.lane_seq == le.c.lane_seq)
    lease_view = (select(le, r.c.kind, r.c.args, r.c.payload, r.c.run_at, r.c.created_at, r.c.unique_key,
                         r.c.unique_states, st.c.progress, st.c.callback_filter, st.c.callback_on_complete,
                         st.c.callback_on_fail, st.c.callback_transform, st.c.callback_result,
                         st.c.callback_result.isnot(None).label("has_result"),
                         st.c.heartbeat_at.label("state_heartbeat_at"))
                  .select_from(le.join(r, body_join).outerjoin(
                      st, and_(st.c.job_id == le.c.job_id, st.c.run_lease == le.c.run_lease))))
    token: BindParameter[Any] = bindparam("b_token")
    return {
        "lock_claim": select(c).where(c.c.job_id == job, c.c.run_lease == lease).with_for_update(),
        "insert_lease": pg_insert(le).from_select(lease_cols, select(
            lrs.c.current_slot, lrs.c.generation, c.c.ready_slot, c.c.ready_generation, c.c.job_id,
            c.c.queue, literal("running").cast(le.c.state.type), c.c.priority, c.c.effective_priority,
            c.c.attempt, c.c.run_lease, c.c.max_attempts, c.c.lane_seq, c.c.enqueue_shard, c.c.claim_slot,
            now, c.c.deadline_at, c.c.claimed_at,
        ).select_from(c.join(lrs, literal(True))).where(
            c.c.job_id == job, c.c.run_lease == lease, ~closed, ~has_lease)),
        "mark_materialized": update(c).where(c.c.job_id == job, c.c.run_lease == lease,
                                             c.c.materialized_at.is_(None)).values(materialized_at=now),
        "set_token": update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.state == "running")
        .values(callback_id=token, callback_timeout_at=now + bindparam("timeout", type_=INTERVAL()))
        .returning(le.c.job_id),
        "clear_token": update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.state == "running",
                                        le.c.callback_id.isnot(None))
        .values(callback_id=None, callback_timeout_at=None).returning(le.c.job_id),
        "enter_wait": update(le).where(le.c.job_id == job, le.c.run_lease == lease, le.c.callback_id == token,
                                       le.c.state == "running")
        .values(state="waiting_external", heartbeat_at=None, deadline_at=None).returning(le.c.job_id),
        "by_token": lease_view.where(le.c.callback_id == token, le.c.state.in_(LIVE)).order_by(le.c.run_lease.desc()),
        "by_token_locked": select(le.c.job_id, le.c.run_lease, le.c.state).where(
            le.c.callback_id == token, le.c.state.in_(bindparam("states", expanding=True)))
        .order_by(le.c.run_lease.desc()).with_for_update(),
        "active": lease_view.where(le.c.job_id == job, le.c.run_lease == lease, le.c.state.in_(LIVE)),
        "newest": lease_view.where(le.c.job_id == job).order_by(le.c.run_lease.desc()).limit(1),
        "resume": update(le).where(le.c.callback_id == token, le.c.state.in_(LIVE),
                                   le.c.job_id == job, le.c.run_lease == lease)
        .values(state="running", callback_id=None, callback_timeout_at=None, heartbeat_at=now)
        .returning(le.c.job_id, le.c.run_lease),
        "extend": update(le).where(le.c.callback_id == token, le.c.state == "waiting_external")
        .values(callback_timeout_at=now + bindparam("timeout", type_=INTERVAL()))
        .returning(le.c.job_id),
        "store_result": pg_insert(st).values(job_id=job, run_lease=lease,
                                             callback_result=bindparam("result", type_=JSONB(none_as_null=False)),
                                             updated_at=now),
        # SQL NULL, not JSON null: a consumed result must read as absent
        "consume_result": update(st).where(st.c.job_id == job, st.c.run_lease == lease)
        .values(callback_result=null(), updated_at=now),
        "clear_cel": update(st).where(st.c.job_id == job, st.c.run_lease == lease).values(
            callback_filter=None, callback_on_complete=None, callback_on_fail=None, callback_transform=None),
    }


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


def materialize(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> None:
    """Give an open receipt a lease row (claim row locked first; no-op if already leased,
    closed or absent). The receipt stays open until the lease leaves."""
    s = _statements(sch)
    arg = {"b_job": job_id, "b_lease": run_lease}
    if conn.execute(s["lock_claim"], arg).first() is None:
        return
    if conn.execute(s["insert_lease"], arg).rowcount:
        conn.execute(s["mark_materialized"], arg)


def _check_config(config: CallbackConfig | None) -> None:
    if config is None:
        return
    for name in ("filter", "on_complete", "on_fail", "transform"):
        expr = getattr(config, name)
        if expr is not None and str(expr).strip():
            raise ValidationError(f"callback_config.{name}", expr,
                                  "CEL callback expressions are not supported by qstore")


def register(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int, timeout: timedelta,
             config: CallbackConfig | None = None) -> uuid.UUID:
    """Park-ready token for the running attempt; a newer registration replaces the token."""
    _check_config(config)
    materialize(conn, sch, job_id, run_lease)
    token = uuid.uuid4()
    s = _statements(sch)
    arg = {"b_job": job_id, "b_lease": run_lease}
    if conn.execute(s["set_token"], {**arg, "b_token": token, "timeout": timeout}).first() is None:
        raise ValidationError("job", (job_id, run_lease), "job is not in running state")
    conn.execute(s["clear_cel"], arg)
    return token


def cancel_callback(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> bool:
    s = _statements(sch)
    arg = {"b_job": job_id, "b_lease": run_lease}
    done = conn.execute(s["clear_token"], arg).first() is not None
    if done:
        conn.execute(s["clear_cel"], arg)
    return done


def enter_wait(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int, token: uuid.UUID) -> bool:
    return conn.execute(_statements(sch)["enter_wait"], {
        "b_job": job_id, "b_lease": run_lease, "b_token": token}).first() is not None


def load_active_lease(conn: Connection, sch: StorageSchema, job_id: int, run_lease: int) -> JobRow | None:
    x = conn.execute(_statements(sch)["active"], {"b_job": job_id, "b_lease": run_lease}).first()
    return _lease_job_row(x) if x is not None else None


def callback_job(conn: Connection, sch: StorageSchema, token: uuid.UUID, run_lease: int | None,
                 for_update: bool = False) -> JobRow | None:
    s = _statements(sch)
    if for_update:
        locked = conn.execute(s["by_token_locked"], {"b_token": token, "states": list(LIVE)}).all()
        if not any(run_lease is None or r.run_lease == run_lease for r in locked):
            return None
    for x in conn.execute(s["by_token"], {"b_token": token}):
        if run_lease is None or x.run_lease == run_lease:
            return _lease_job_row(x)
    return None


def _locked_attempt(conn: Connection, sch: StorageSchema, token: uuid.UUID, run_lease: int | None,
                    states: tuple[str, ...]) -> tuple[int, int] | None:
    for r in conn.execute(_statements(sch)["by_token_locked"], {"b_token": token, "states": list(states)}):
        if run_lease is None or r.run_lease == run_lease:
            return (r.job_id, r.run_lease)
    return None


def resolve(conn: Connection, sch: StorageSchema, router: LaneRouter, token: uuid.UUID, run_lease: int | None,
            decision: Decision, label: str, states: tuple[str, ...] = LIVE) -> JobRow:
    """End the attempt holding ``token`` with ``decision``; ``CallbackNotFoundError`` if none."""
    pair = _locked_attempt(conn, sch, token, run_lease, states)
    taken = take_attempts(conn, sch, [pair], label, states) if pair else []
    if not taken:
        raise CallbackNotFoundError(token)
    t = taken[0]
    body = Body.from_taken(t)
    if decision.kind == "terminal" and decision.state == JobState.COMPLETED:
        body = Body.from_taken(t, None)
    return apply(conn, sch, router, [(body, decision, t.old_state)], ready_payloads={t.job_id: t.payload})[0]


def resume(conn: Connection, sch: StorageSchema, token: uuid.UUID, payload: Any, run_lease: int | None) -> JobRow:
    """Hand ``payload`` back to the same attempt: waiting/running → running, token cleared."""
    pair = _locked_attempt(conn, sch, token, run_lease, LIVE)
    if pair is None:
        raise CallbackNotFoundError(token)
    s = _statements(sch)
    arg = {"b_job": pair[0], "b_lease": pair[1]}
    if conn.execute(s["resume"], {**arg, "b_token": token}).first() is None:
        raise CallbackNotFoundError(token)
    st = sch.attempt_state
    stmt = s["store_result"]
    conn.execute(stmt.on_conflict_do_update(
        index_elements=[st.c.job_id, st.c.run_lease],
        set_={"callback_result": stmt.excluded.callback_result, "updated_at": stmt.excluded.updated_at},
    ), {**arg, "result": payload})
    conn.execute(s["clear_cel"], arg)
    row = load_active_lease(conn, sch, *pair)
    assert row is not None
    return row


def heartbeat_callback(conn: Connection, sch: StorageSchema, token: uuid.UUID, timeout: timedelta) -> int:
    row = conn.execute(_statements(sch)["extend"], {"b_token": token, "timeout": timeout}).first()
    if row is None:
        raise CallbackNotFoundError(token)
    return int(row.job_id)


def check_callback_state(conn: Connection, sch: StorageSchema, job_id: int, token: uuid.UUID,
                         load_state: Any) -> CallbackPollResult:
    s = _statements(sch)
    x = conn.execute(s["newest"], {"b_job": job_id}).first()
    if x is None:
        state = load_state()
        return CallbackPollResult("not_found") if state is None else CallbackPollResult(
            "unexpected_state", token=token, state=state)
    state = JobState(x.state)
    if state == JobState.RUNNING and x.callback_id is None and x.has_result:
        conn.execute(s["consume_result"], {"b_job": x.job_id, "b_lease": x.run_lease})
        return CallbackPollResult("resolved", payload=x.callback_result)
    if x.callback_id != token:
        return CallbackPollResult("stale", token=token, current=x.callback_id, state=state)
    if state == JobState.WAITING_EXTERNAL:
        return CallbackPollResult("pending", token=token, state=state)
    return CallbackPollResult("unexpected_state", token=token, state=state)
