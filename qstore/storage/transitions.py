"""Apply where finished attempts (or detached bodies) go next, in one place.

Every outcome, rescue, callback resolution and admin move builds a list of
``(Body, Decision, old_state)`` and calls :func:`apply`; it writes the destination rows,
appends error entries, syncs unique keys and returns the resulting :class:`JobRow` s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, func, select

from qstore.model import JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage import unique
from qstore.storage.enqueue import LaneRouter
from qstore.storage.jobs import logical_queue
from qstore.storage.writers import (
    Body,
    error_entry,
    job_row,
    now,
    reenqueue,
    write_deferred,
    write_dlq,
    write_terminal,
)

__all__ = ["Decision", "apply", "backoff", "dlq_enabled"]


@dataclass(frozen=True)
class Decision:
    """``kind``: "deferred" (state + delay), "terminal" (state), "dlq" (reason) or "ready"."""

    kind: str
    state: JobState | None = None
    delay: timedelta | None = None  # for deferred; None = backoff(attempt)
    reason: str | None = None  # dlq reason
    error: str | None = None
    error_obj: dict[str, Any] | None = None  # caller-supplied error entry
    terminal_error: bool = False
    attempt: int | None = None  # absolute attempt override (admin retries reset to 0)
    attempt_delta: int = 0  # snooze gives the attempt back
    clear_progress: bool = False
    unique_owner: int | None = None  # the job lost its unique key to this job: it does not take it


def backoff(conn: Connection, sch: StorageSchema, attempt: int, max_attempts: int) -> timedelta:
    fn = getattr(func, sch.config.schema).backoff_duration
    return conn.execute(select(fn(attempt, max_attempts))).scalar_one()


@functools.lru_cache(maxsize=64)
def _dlq_stmt(sch: StorageSchema) -> Any:
    m = sch.queue_meta
    return select(m.c.queue).where(m.c.queue.in_(bindparam("queues", expanding=True)), m.c.dlq_enabled)


def dlq_enabled(conn: Connection, sch: StorageSchema, queues: set[str]) -> set[str]:
    """Logical queues (of the given physical names) whose DLQ policy is on."""
    logicals = sorted({logical_queue(q) for q in queues})
    if not logicals:
        return set()
    return set(conn.execute(_dlq_stmt(sch), {"queues": logicals}).scalars())


def _new_state(d: Decision) -> JobState | None:
    return {"deferred": d.state or JobState.RETRYABLE, "terminal": d.state, "dlq": JobState.FAILED,
            "ready": JobState.AVAILABLE}[d.kind]


def _transition(b: Body, d: Decision, old: JobState) -> unique.Transition:
    # a job that lost its key to another job ends without it (new=None: holds nothing)
    new = None if d.unique_owner is not None else _new_state(d)
    return unique.Transition(b.job_id, b.unique_key, b.unique_states, old, new)


def _fail_unique_losers(conn: Connection, sch: StorageSchema,
                        items: Sequence[tuple[Body, Decision, JobState]]) -> list[tuple[Body, Decision, JobState]]:
    """For automatic transitions (promotion, rescue): a job whose next state would take its
    unique key while another job owns it must not hold back the others. It ends ``failed``
    (terminal) instead, with an error entry naming the key and its owner; the first of two
    jobs of one batch that want the same key wins it."""
    wanted = [(b.unique_key, b.job_id) for b, d, old in items
              if b.unique_key is not None and unique.takes_key(_transition(b, d, old))]
    lost = unique.try_acquire(conn, sch, wanted) if wanted else {}
    if not lost:
        return list(items)
    out = []
    for b, d, old in items:
        owner = lost.get(b.job_id)
        if owner is None:
            out.append((b, d, old))
            continue
        assert b.unique_key is not None
        who = f"job {owner}" if owner >= 0 else "another job"
        entry = {"error": f"unique key {b.unique_key.hex()} is owned by {who}; "
                          f"the job cannot become {_new_state(d).value}",  # type: ignore[union-attr]
                 "attempt": b.attempt, "terminal": True, "unique_owner": owner}
        out.append((b, Decision("terminal", JobState.FAILED, error_obj=entry, unique_owner=owner), old))
    return out


def apply(conn: Connection, sch: StorageSchema, router: LaneRouter,
          items: Sequence[tuple[Body, Decision, JobState]], *, ready_payloads: dict[int, Any] | None = None,
          unique_conflicts: str = "raise") -> list[JobRow]:
    """Write every item's destination on ``conn``'s transaction; returns new JobRows in order.

    ``unique_conflicts``: ``"raise"`` (user-initiated calls) raises
    :class:`~qstore.errors.UniqueConflictError` when a job would take a key another job
    owns, and the caller's transaction must not commit; ``"fail"`` (automatic paths) ends
    each such job failed instead (see :func:`_fail_unique_losers`) and carries on.
    """
    if not items:
        return []
    at = now(conn)
    if unique_conflicts == "fail":
        items = _fail_unique_losers(conn, sch, items)
    elif unique_conflicts != "raise":  # pragma: no cover - programming error
        raise ValueError(unique_conflicts)
    prepared: list[tuple[Body, Decision, JobState]] = []
    for body, d, old in items:
        errors = list(body.errors)
        if d.error_obj is not None:
            errors.append({**d.error_obj, "at": d.error_obj.get("at", at.isoformat())})
        elif d.error is not None:
            errors.append(error_entry(d.error, body.attempt, at, terminal=d.terminal_error))
        attempt = d.attempt if d.attempt is not None else max(0, body.attempt + d.attempt_delta)
        progress = None if d.clear_progress else body.progress
        prepared.append((replace(body, errors=errors, attempt=attempt, progress=progress), d, old))

    out: list[JobRow | None] = [None] * len(prepared)
    deferred, terminal, dlq, ready = [], [], [], []
    for i, (b, d, _old) in enumerate(prepared):
        if d.kind == "deferred":
            delay = d.delay if d.delay is not None else backoff(conn, sch, b.attempt, b.max_attempts)
            run_at = at + delay
            st = d.state or JobState.RETRYABLE
            fin = at if st == JobState.RETRYABLE else None
            deferred.append((b, st, run_at, fin))
            out[i] = job_row(b, st, run_at=run_at, finalized_at=fin)
        elif d.kind == "terminal":
            assert d.state is not None
            terminal.append((b, d.state))
            out[i] = job_row(b, d.state, finalized_at=at)
        elif d.kind == "dlq":
            dlq.append((b, d.reason or "dlq", b.run_lease))
            out[i] = job_row(b, JobState.FAILED, finalized_at=at)
        elif d.kind == "ready":
            ready.append((i, b))
        else:  # pragma: no cover - programming error
            raise ValueError(d.kind)
    unique.sync(conn, sch, [_transition(b, d, old) for b, d, old in prepared])
    write_deferred(conn, sch, deferred)
    write_terminal(conn, sch, terminal, at, ready_payloads=ready_payloads)
    write_dlq(conn, sch, dlq, at)
    if ready:
        placed = reenqueue(conn, sch, router, [b for _, b in ready])
        for (i, _), (b, run_at) in zip(ready, placed, strict=True):
            out[i] = job_row(b, JobState.AVAILABLE, run_at=run_at, attempted_at=None)
    return [r for r in out if r is not None]


def exhausted(body: Body) -> bool:
    return body.attempt >= body.max_attempts


