"""Writing where jobs go next: the write step of every transition.

Every outcome, rescue, callback resolution, promotion and admin move builds a list of
``(Body, Decision, old_state)`` and calls :func:`apply`; it adds error entries, syncs unique
keys (control plane) and writes the destination rows (queue plane), and returns the
resulting :class:`~qstore.types.JobRow` s.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, select

from qstore.schema import StorageSchema
from qstore.storage.bodies import Body, error_entry, job_row
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination
from qstore.storage.jobs import PreparedJob, logical_queue
from qstore.storage.lanes import assign_lanes
from qstore.storage.planes import control, queue
from qstore.storage.statements import schema_func
from qstore.types import JobRow, JobState

__all__ = ["UniqueConflicts", "apply", "now", "reenqueue"]


class UniqueConflicts(enum.Enum):
    """What a transition does when its job would take a unique key another job owns."""

    RAISE = "raise"  # user-initiated calls: UniqueConflictError; the transaction must not commit
    FAIL_JOB = "fail_job"  # automatic paths: that job ends failed, the others go on


def now(conn: Connection) -> datetime:
    """The server's clock (``clock_timestamp()``)."""
    return conn.execute(select(func.clock_timestamp())).scalar_one()


def backoff(conn: Connection, sch: StorageSchema, attempt: int, max_attempts: int) -> timedelta:
    """The install's ``backoff_duration(attempt, max_attempts)``."""
    return conn.execute(select(schema_func(sch, "backoff_duration", attempt, max_attempts))).scalar_one()


def _ready_row(b: Body) -> PreparedJob:
    """The new ready row of an existing job (its id, body and physical queue kept)."""
    j = b.job
    return PreparedJob(kind=j.kind, args=j.args, queue=j.queue, logical=logical_queue(j.queue),
                       priority=j.priority, max_attempts=j.max_attempts, run_at=None, payload=b.payload,
                       unique_key=j.unique_key, unique_states=j.unique_states, ordering_key=None, job_id=j.id)


def reenqueue(conn: Connection, ctx: StorageContext, bodies: Sequence[Body]) -> list[tuple[Body, datetime]]:
    """Fresh ready rows for existing jobs (lane reservation as enqueue; run_lease kept;
    ``run_at`` = now), NOTIFY on commit. Returns each body with its new ``run_at``."""
    if not bodies:
        return []
    sch = ctx.schema
    rows = [_ready_row(b) for b in bodies]
    jobs = [b.job for b in bodies]
    assign_lanes(conn, ctx, rows)
    queue.insert_ready(conn, sch, rows, attempts=[j.attempt for j in jobs],
                       run_leases=[j.run_lease for j in jobs], created=[j.created_at for j in jobs])
    queue.notify_queues(conn, sch, {r.logical for r in rows})
    at = now(conn)
    return [(b.replace(attempted_at=None), at) for b in bodies]


def _transition(b: Body, d: Decision, old: JobState) -> control.Transition:
    # a job that lost its key to another job ends without it (new=None: holds nothing)
    new = None if d.unique_owner is not None else d.new_state
    return control.Transition(b.job.id, b.job.unique_key, b.job.unique_states, old, new)


def _fail_unique_losers(conn: Connection, sch: StorageSchema,
                        items: Sequence[tuple[Body, Decision, JobState]]) -> list[tuple[Body, Decision, JobState]]:
    """A job whose next state would take its unique key while another job owns it must not
    hold back the others: it ends ``failed`` (terminal) instead, with an error entry naming
    the key and its owner; the first of two jobs of one batch that want a key wins it."""
    wanted = [(b.job.unique_key, b.job.id) for b, d, old in items
              if b.job.unique_key is not None and control.takes_key(_transition(b, d, old))]
    lost = control.try_acquire_keys(conn, sch, wanted) if wanted else {}
    if not lost:
        return list(items)
    out = []
    for b, d, old in items:
        owner = lost.get(b.job.id)
        if owner is None:
            out.append((b, d, old))
            continue
        assert b.job.unique_key is not None and d.new_state is not None
        who = f"job {owner}" if owner >= 0 else "another job"
        entry = {"error": f"unique key {b.job.unique_key.hex()} is owned by {who}; "
                          f"the job cannot become {d.new_state.value}",
                 "attempt": b.job.attempt, "terminal": True, "unique_owner": owner}
        out.append((b, Decision(Destination.TERMINAL, JobState.FAILED, error_obj=entry, unique_owner=owner), old))
    return out


def apply(conn: Connection, ctx: StorageContext, items: Sequence[tuple[Body, Decision, JobState]], *,
          ready_payloads: dict[int, Any] | None = None,
          unique_conflicts: UniqueConflicts = UniqueConflicts.RAISE) -> list[JobRow]:
    """Write every item's destination on ``conn``'s transaction; returns the new JobRows in
    order. ``ready_payloads`` (job id → its ready row's payload) lets a narrow done row omit
    a payload equal to the ready row's."""
    if not items:
        return []
    sch = ctx.schema
    at = now(conn)
    if unique_conflicts is UniqueConflicts.FAIL_JOB:
        items = _fail_unique_losers(conn, sch, items)
    prepared: list[tuple[Body, Decision, JobState]] = []
    for body, d, old in items:
        job = body.job
        errors = list(job.errors or ())
        if d.error_obj is not None:
            errors.append({**d.error_obj, "at": d.error_obj.get("at", at.isoformat())})
        elif d.error is not None:
            errors.append(error_entry(d.error, job.attempt, at, terminal=d.terminal_error))
        attempt = d.attempt if d.attempt is not None else max(0, job.attempt + d.attempt_delta)
        progress = None if d.clear_progress else job.progress
        prepared.append((body.replace(errors=errors or None, attempt=attempt, progress=progress), d, old))

    out: list[JobRow | None] = [None] * len(prepared)
    deferred, terminal, dlq, ready = [], [], [], []
    for i, (b, d, _old) in enumerate(prepared):
        if d.destination is Destination.DEFERRED:
            delay = d.delay if d.delay is not None else backoff(conn, sch, b.job.attempt, b.job.max_attempts)
            st = d.state or JobState.RETRYABLE
            fin = at if st == JobState.RETRYABLE else None
            deferred.append((b, st, at + delay, fin))
            out[i] = job_row(b, st, run_at=at + delay, finalized_at=fin)
        elif d.destination is Destination.TERMINAL:
            assert d.state is not None
            terminal.append((b, d.state))
            out[i] = job_row(b, d.state, finalized_at=at)
        elif d.destination is Destination.DLQ:
            dlq.append((b, d.reason or "dlq", b.job.run_lease))
            out[i] = job_row(b, JobState.FAILED, finalized_at=at)
        else:
            ready.append((i, b))
    control.sync_keys(conn, sch, [_transition(b, d, old) for b, d, old in prepared])
    queue.write_deferred(conn, sch, deferred)
    queue.write_terminal(conn, sch, terminal, at, ready_payloads=ready_payloads)
    queue.write_dlq(conn, sch, dlq, at)
    if ready:
        placed = reenqueue(conn, ctx, [b for _, b in ready])
        for (i, _), (b, run_at) in zip(ready, placed, strict=True):
            out[i] = job_row(b, JobState.AVAILABLE, run_at=run_at, attempted_at=None)
    return [r for r in out if r is not None]


def logical(body: Body) -> str:
    """The logical queue of ``body``'s (physical) queue."""
    return logical_queue(body.job.queue)


def dlq_queues(conn: Connection, sch: StorageSchema, bodies: Sequence[Body]) -> set[str]:
    """Logical queues of ``bodies`` whose DLQ policy is on."""
    return control.dlq_enabled(conn, sch, {logical_queue(b.job.queue) for b in bodies})
