"""Worker outcomes of a live attempt, and its heartbeats and progress.

Every outcome is guarded by ``(job_id, run_lease)``: a stale call returns ``None`` and
changes nothing. Each one flows take → decide → write: the execution plane takes the
attempt out of running (:func:`~qstore.storage.planes.execution.take_attempts`), the
outcome is turned into a destination (:func:`qstore.storage.decide.decide`), and the
destination is written (:func:`qstore.storage.destinations.apply`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from qstore.storage import destinations
from qstore.storage.bodies import Body
from qstore.storage.checks import ms
from qstore.storage.context import StorageContext
from qstore.storage.decide import Outcome, decide
from qstore.storage.jobs import logical_queue
from qstore.storage.planes import control, execution
from qstore.types import JobRow

__all__ = [
    "cancel_running",
    "fail_retryable",
    "fail_terminal",
    "fail_to_dlq",
    "flush_progress",
    "heartbeat_batch",
    "heartbeat_progress_batch",
    "retry_after",
    "snooze",
]


def _finish(ctx: StorageContext, conn: Connection, outcome: Outcome, job_id: int, run_lease: int,
            progress: Any, *, delay: timedelta | None = None, reason: str | None = None,
            error: str | None = None) -> JobRow | None:
    sch = ctx.schema
    taken = execution.take_attempts(conn, sch, [(job_id, run_lease)], outcome.closure)
    if not taken:
        return None
    t = taken[0]
    body = Body.from_taken(t, progress)
    dlq_on = (outcome is Outcome.FAIL_RETRYABLE
              and bool(control.dlq_enabled(conn, sch, {logical_queue(body.job.queue)})))
    d = decide(outcome, body, dlq_on=dlq_on, delay=delay, reason=reason, error=error)
    return destinations.apply(conn, ctx, [(body, d, t.old_state)], ready_payloads={t.job_id: t.payload})[0]


def _delay(value: timedelta | float) -> timedelta:
    return timedelta(milliseconds=ms(value))


def retry_after(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
                retry_after: timedelta | float, progress: Any = None) -> JobRow | None:
    """Live attempt -> retryable, due ``retry_after`` from now (attempt kept)."""
    return _finish(ctx, conn, Outcome.RETRY_AFTER, job_id, run_lease, progress, delay=_delay(retry_after))


def snooze(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int,
           snooze_for: timedelta | float, progress: Any = None) -> JobRow | None:
    """Live attempt -> scheduled ``snooze_for`` from now; the attempt is given back."""
    return _finish(ctx, conn, Outcome.SNOOZE, job_id, run_lease, progress, delay=_delay(snooze_for))


def cancel_running(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int, reason: str,
                   progress: Any = None) -> JobRow | None:
    """Live attempt -> cancelled (terminal), with the reason as an error entry."""
    return _finish(ctx, conn, Outcome.CANCEL, job_id, run_lease, progress, reason=reason)


def fail_terminal(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int, error: str,
                  progress: Any = None) -> JobRow | None:
    """Live attempt -> failed (terminal), with a terminal error entry."""
    return _finish(ctx, conn, Outcome.FAIL_TERMINAL, job_id, run_lease, progress, error=error)


def fail_to_dlq(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int, dlq_reason: str,
                error: str, progress: Any = None) -> JobRow | None:
    """Live attempt -> the DLQ (state failed), with a terminal error entry."""
    return _finish(ctx, conn, Outcome.FAIL_TO_DLQ, job_id, run_lease, progress, reason=dlq_reason, error=error)


def fail_retryable(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int, error: str,
                   progress: Any = None) -> JobRow | None:
    """Retryable with backoff; when attempts are exhausted -> failed, or the DLQ when the
    queue's DLQ policy (``queue_meta.dlq_enabled``) is on."""
    return _finish(ctx, conn, Outcome.FAIL_RETRYABLE, job_id, run_lease, progress, error=error)


def heartbeat_batch(ctx: StorageContext, conn: Connection, jobs: Sequence[tuple[int, int]]) -> int:
    """Record heartbeats of live attempts; returns how many were live."""
    return execution.heartbeat(conn, ctx.schema, [(j, r, None) for j, r in jobs],
                               with_heartbeat=True, with_progress=False)


def heartbeat_progress_batch(ctx: StorageContext, conn: Connection, jobs: Sequence[tuple[int, int, Any]]) -> int:
    """Record heartbeats and progress of live attempts; returns how many were live."""
    return execution.heartbeat(conn, ctx.schema, list(jobs), with_heartbeat=True, with_progress=True)


def flush_progress(ctx: StorageContext, conn: Connection, job_id: int, run_lease: int, progress: Any) -> None:
    """Store progress for the live attempt (running or waiting); silent no-op if stale."""
    execution.heartbeat(conn, ctx.schema, [(job_id, run_lease, progress)], with_heartbeat=False,
                        with_progress=True, lease_states=execution.LIVE)
