"""Worker outcomes of a live attempt and its heartbeats/progress.

Every outcome is guarded by ``(job_id, run_lease)``: a stale call returns ``None`` and
changes nothing. Mutable per-attempt state (``attempt_state``) is created only when an
attempt heartbeats or reports progress and is removed when the attempt ends; a heartbeat
sets the receipt's ``materialized_at`` at most once and never rewrites it (trap T8).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Connection, and_, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.model import JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage.attempts import take_attempts
from qstore.storage.enqueue import LaneRouter
from qstore.storage.statements import receipt_closed, unnest_rows
from qstore.storage.transitions import Decision, apply, dlq_enabled, exhausted
from qstore.storage.writers import Body

__all__ = ["finish_live", "heartbeat", "outcome"]

_OUTCOME_LABEL = {
    "retry_after": "retryable", "snooze": "scheduled", "cancel_running": "cancelled",
    "fail_terminal": "failed", "fail_to_dlq": "dlq", "fail_retryable": "failed",
}


def finish_live(conn: Connection, sch: StorageSchema, router: LaneRouter, job_id: int, run_lease: int,
                label: str, decide: Any, progress: Any = None,
                lease_states: Sequence[str] = ("running",)) -> JobRow | None:
    """Take the live attempt ``(job_id, run_lease)`` and apply ``decide(body) -> Decision``."""
    taken = take_attempts(conn, sch, [(job_id, run_lease)], label, lease_states)
    if not taken:
        return None
    t = taken[0]
    body = Body.from_taken(t, progress)
    return apply(conn, sch, router, [(body, decide(body), t.old_state)],
                 ready_payloads={t.job_id: t.payload})[0]


def outcome(conn: Connection, sch: StorageSchema, router: LaneRouter, name: str, job_id: int,
            run_lease: int, *, delay: timedelta | None = None, reason: str | None = None,
            error: str | None = None, progress: Any = None) -> JobRow | None:
    """The worker outcomes of STORAGE.md §7.5 by seed name."""

    def decide(b: Body) -> Decision:
        if name == "retry_after":
            return Decision("deferred", JobState.RETRYABLE, delay=delay)
        if name == "snooze":
            return Decision("deferred", JobState.SCHEDULED, delay=delay, attempt_delta=-1)
        if name == "cancel_running":
            return Decision("terminal", JobState.CANCELLED, error=f"cancelled: {reason or ''}".rstrip(": "))
        if name == "fail_terminal":
            return Decision("terminal", JobState.FAILED, error=error, terminal_error=True)
        if name == "fail_to_dlq":
            return Decision("dlq", reason=reason, error=error, terminal_error=True)
        if name == "fail_retryable":
            if exhausted(b):
                if dlq_enabled(conn, sch, {b.queue}):
                    return Decision("dlq", reason="max_attempts_exhausted", error=error, terminal_error=True)
                return Decision("terminal", JobState.FAILED, error=error, terminal_error=True)
            return Decision("deferred", JobState.RETRYABLE, error=error)
        raise ValueError(name)

    return finish_live(conn, sch, router, job_id, run_lease, _OUTCOME_LABEL[name], decide, progress)


@functools.lru_cache(maxsize=64)
def _hb_statements(sch: StorageSchema) -> dict[str, Any]:
    c, cl, le = sch.claims.parent, sch.closures.parent, sch.leases.parent
    p = unnest_rows("p", job_id=BigInteger(), run_lease=BigInteger(), progress=JSONB())
    on_c = and_(c.c.job_id == p.c.job_id, c.c.run_lease == p.c.run_lease)
    closed = receipt_closed(cl, c)
    now = func.clock_timestamp()
    return {
        # lock open receipts (a lock first, so the later statements see every committed closure)
        "lock": select(c.c.claim_slot, c.c.job_id, c.c.run_lease, c.c.materialized_at)
        .select_from(c.join(p, on_c)).where(~closed).order_by(c.c.job_id, c.c.run_lease)
        .with_for_update(of=c),
        "open": select(c.c.job_id, c.c.run_lease).select_from(c.join(p, on_c)).where(~closed),
        "lease_running": select(le.c.job_id, le.c.run_lease).select_from(
            le.join(p, and_(le.c.job_id == p.c.job_id, le.c.run_lease == p.c.run_lease)))
        .where(le.c.state.in_(bindparam("states", expanding=True))),
        "materialize": update(c).where(
            c.c.job_id == bindparam("b_job_id"), c.c.run_lease == bindparam("b_run_lease"),
            c.c.claim_slot == bindparam("b_claim_slot"), c.c.materialized_at.is_(None),
        ).values(materialized_at=now),
    }


def _upsert_state(conn: Connection, sch: StorageSchema, rows: Sequence[tuple[int, int, Any]],
                  *, heartbeat: bool, progress: bool) -> None:
    if not rows:
        return
    st = sch.attempt_state
    now = func.clock_timestamp()
    stmt = pg_insert(st).values([
        {"job_id": j, "run_lease": r, **({"heartbeat_at": now} if heartbeat else {}),
         **({"progress": pg} if progress else {}), "updated_at": now}
        for j, r, pg in rows
    ])
    sets: dict[str, Any] = {"updated_at": stmt.excluded.updated_at}
    if heartbeat:
        sets["heartbeat_at"] = stmt.excluded.heartbeat_at
    if progress:
        sets["progress"] = stmt.excluded.progress
    conn.execute(stmt.on_conflict_do_update(index_elements=[st.c.job_id, st.c.run_lease], set_=sets))


def heartbeat(conn: Connection, sch: StorageSchema, items: Sequence[tuple[int, int, Any]], *,
              with_heartbeat: bool, with_progress: bool,
              lease_states: Sequence[str] = ("running",)) -> int:
    """Record heartbeats and/or progress for the live attempts among ``items``
    (``(job_id, run_lease, progress)``); returns how many were live."""
    items = list({(int(j), int(r)): (int(j), int(r), pg) for j, r, pg in items}.values())
    if not items:
        return 0
    s = _hb_statements(sch)
    arg = {"job_id": [i[0] for i in items], "run_lease": [i[1] for i in items],
           "progress": [i[2] for i in items]}
    locked = conn.execute(s["lock"], arg).all()
    leased = {tuple(r) for r in conn.execute(s["lease_running"], {**arg, "states": list(lease_states)})}
    open_now = {tuple(r) for r in conn.execute(s["open"], arg)} if locked else set()
    # receipts-off installs have no claims: the lease alone identifies the live attempt
    live = [i for i in items if (i[0], i[1]) in open_now or (i[0], i[1]) in leased]
    if not live:
        return 0
    for r in locked:
        if r.materialized_at is None and (r.job_id, r.run_lease) in open_now:
            conn.execute(s["materialize"], {"b_job_id": r.job_id, "b_run_lease": r.run_lease,
                                            "b_claim_slot": r.claim_slot})
    _upsert_state(conn, sch, live, heartbeat=with_heartbeat, progress=with_progress)
    return len(live)


