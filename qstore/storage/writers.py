"""Where a job goes next: the shared writers every transition uses.

* :func:`reenqueue` — a new ready row for an existing job id (fresh lane position, run_lease
  kept, ``run_at`` = now), NOTIFY on commit;
* :func:`write_deferred` — scheduled / retryable backlog rows;
* :func:`write_terminal` — narrow done rows for claimed attempts, wide rows otherwise;
* :func:`write_dlq` — dead-letter rows;
* :func:`job_row` — the public :class:`JobRow` of a body in a given state.
Payload rules (STORAGE.md §6.3): metadata/tags/errors/progress, empty members omitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, insert, select

from qstore.model import JobRow, JobState
from qstore.schema import StorageSchema
from qstore.storage import enqueue
from qstore.storage.attempts import Taken, write_deltas
from qstore.storage.jobs import PreparedJob, build_payload, logical_queue

__all__ = ["Body", "error_entry", "job_row", "now", "reenqueue", "write_deferred", "write_dlq", "write_terminal"]


@dataclass(frozen=True)
class Body:
    """A job's durable body plus where its attempt stood (ring keys only for claimed ones)."""

    job_id: int
    kind: str
    queue: str
    args: Any
    priority: int
    attempt: int
    run_lease: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    unique_key: bytes | None
    unique_states: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    progress: Any = None
    attempted_at: datetime | None = None
    # ring keys of the ready row this body came from (narrow done rows need them)
    ready_slot: int | None = None
    ready_generation: int | None = None
    enqueue_shard: int = 0
    lane_seq: int | None = None
    effective_priority: int | None = None

    @property
    def payload(self) -> dict[str, Any] | None:
        return build_payload(self.metadata, self.tags, self.errors, self.progress)

    @classmethod
    def from_taken(cls, t: Taken, progress: Any = None) -> Body:
        return cls(
            job_id=t.job_id, kind=t.kind, queue=t.queue, args=t.args, priority=t.priority,
            attempt=t.attempt, run_lease=t.run_lease, max_attempts=t.max_attempts, run_at=t.run_at,
            created_at=t.created_at, unique_key=t.unique_key, unique_states=t.unique_states,
            metadata=t.metadata, tags=t.tags, errors=t.errors,
            progress=progress if progress is not None else t.progress,
            attempted_at=t.attempted_at, ready_slot=t.ready_slot,
            ready_generation=t.ready_generation, enqueue_shard=t.enqueue_shard,
            lane_seq=t.lane_seq, effective_priority=t.effective_priority,
        )

    @classmethod
    def from_snapshot(cls, row: Any) -> Body:
        """From a deferred / DLQ / terminal_jobs row (wide job snapshot)."""
        p = row.payload or {}
        return cls(
            job_id=row.job_id, kind=row.kind, queue=row.queue, args=row.args, priority=row.priority,
            attempt=row.attempt, run_lease=row.run_lease, max_attempts=row.max_attempts,
            run_at=row.run_at, created_at=row.created_at, unique_key=row.unique_key,
            unique_states=row.unique_states, metadata=dict(p.get("metadata") or {}),
            tags=list(p.get("tags") or []), errors=list(p.get("errors") or []),
            progress=p.get("progress"), attempted_at=row.attempted_at,
        )


def now(conn: Connection) -> datetime:
    return conn.execute(select(func.clock_timestamp())).scalar_one()


def error_entry(message: str, attempt: int, at: datetime, *, terminal: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"error": message, "attempt": attempt, "at": at.isoformat()}
    if terminal:
        entry["terminal"] = True
    return entry


def job_row(b: Body, state: JobState, **overrides: Any) -> JobRow:
    fields: dict[str, Any] = dict(
        id=b.job_id, kind=b.kind, queue=b.queue, args=b.args, state=state, priority=b.priority,
        attempt=b.attempt, run_lease=b.run_lease, max_attempts=b.max_attempts, run_at=b.run_at,
        created_at=b.created_at, attempted_at=b.attempted_at, errors=list(b.errors) or None,
        metadata=dict(b.metadata), tags=list(b.tags), unique_key=b.unique_key,
        unique_states=b.unique_states, progress=b.progress,
    )
    fields.update(overrides)
    return JobRow(**fields)


def reenqueue(conn: Connection, sch: StorageSchema, router: enqueue.LaneRouter,
              bodies: Sequence[Body]) -> list[tuple[Body, datetime]]:
    """Insert fresh ready rows for existing jobs (lane reservation as enqueue; run_at = now).
    Returns each body with its new ``run_at``."""
    if not bodies:
        return []
    rows = [PreparedJob(
        kind=b.kind, args=b.args, queue=b.queue, logical=logical_queue(b.queue), priority=b.priority,
        max_attempts=b.max_attempts, run_at=None, payload=b.payload, unique_key=b.unique_key,
        unique_states=b.unique_states, ordering_key=None, job_id=b.job_id,
    ) for b in bodies]
    enqueue.assign_lanes(conn, sch, router, rows)
    params = enqueue.ready_params(rows, attempts=[b.attempt for b in bodies],
                                  run_leases=[b.run_lease for b in bodies],
                                  created=[b.created_at for b in bodies])
    conn.execute(enqueue.statements(sch)["ready"], params)
    enqueue.notify_queues(conn, sch, {r.logical for r in rows})
    at = now(conn)
    return [(replace(b, attempted_at=None), at) for b in bodies]


def write_deferred(conn: Connection, sch: StorageSchema, items: Sequence[tuple[Body, JobState, datetime, datetime | None]]) -> None:
    """``(body, scheduled|retryable, run_at, finalized_at)`` rows into the deferred backlog."""
    if not items:
        return
    conn.execute(insert(sch.deferred), [{
        "job_id": b.job_id, "kind": b.kind, "queue": b.queue, "args": b.args, "state": st.value,
        "priority": b.priority, "attempt": b.attempt, "run_lease": b.run_lease,
        "max_attempts": b.max_attempts, "run_at": run_at, "attempted_at": b.attempted_at,
        "finalized_at": fin, "created_at": b.created_at, "unique_key": b.unique_key,
        "unique_states": b.unique_states, "payload": b.payload,
    } for b, st, run_at, fin in items])


def write_terminal(conn: Connection, sch: StorageSchema, items: Sequence[tuple[Body, JobState]],
                   finalized_at: datetime, *, ready_payloads: dict[int, Any] | None = None) -> None:
    """Done rows (+ count deltas). Bodies with ring keys get narrow rows (body columns NULL,
    payload only when it differs from the ready row's); others get wide synthetic rows in
    the current queue slot with ``lane_seq = -job_id`` (never collides with a real lane)."""
    if not items:
        return
    narrow = [(b, st) for b, st in items if b.ready_slot is not None]
    wide = [(b, st) for b, st in items if b.ready_slot is None]
    narrow_rows: list[dict[str, Any]] = []  # body columns absent (NULL)
    for b, st in narrow:
        base = (ready_payloads or {}).get(b.job_id, "__unknown__")
        payload = b.payload
        narrow_rows.append({
            "ready_slot": b.ready_slot, "ready_generation": b.ready_generation, "job_id": b.job_id,
            "kind": b.kind, "queue": b.queue, "state": st.value, "priority": b.priority,
            "attempt": b.attempt, "run_lease": b.run_lease, "lane_seq": b.lane_seq,
            "enqueue_shard": b.enqueue_shard, "attempted_at": b.attempted_at,
            "finalized_at": finalized_at, "payload": None if payload == base else payload,
        })
    wide_rows: list[dict[str, Any]] = []  # the whole body
    if wide:
        slot, gen = conn.execute(enqueue.statements(sch)["ring"]).one()
        for b, st in wide:
            wide_rows.append({
                "ready_slot": slot, "ready_generation": gen, "job_id": b.job_id, "kind": b.kind,
                "queue": b.queue, "state": st.value, "priority": b.priority, "attempt": b.attempt,
                "run_lease": b.run_lease, "lane_seq": -b.job_id, "enqueue_shard": 0,
                "attempted_at": b.attempted_at, "finalized_at": finalized_at, "args": b.args,
                "max_attempts": b.max_attempts, "run_at": b.run_at, "created_at": b.created_at,
                "unique_key": b.unique_key, "unique_states": b.unique_states, "payload": b.payload,
            })
    # the two kinds carry different columns: one executemany each (an executemany takes
    # its column list from its first row)
    for group in (narrow_rows, wide_rows):
        if group:
            conn.execute(insert(sch.done.parent), group)
    write_deltas(conn, sch, [(r["ready_slot"], r["ready_generation"], r["queue"], r["priority"],
                              r["enqueue_shard"], r["job_id"]) for r in (*narrow_rows, *wide_rows)], +1)


def write_dlq(conn: Connection, sch: StorageSchema, items: Sequence[tuple[Body, str, int]], at: datetime) -> None:
    """``(body, dlq_reason, original_run_lease)`` rows into the DLQ (state failed)."""
    if not items:
        return
    conn.execute(insert(sch.dlq), [{
        "job_id": b.job_id, "kind": b.kind, "queue": b.queue, "args": b.args, "state": "failed",
        "priority": b.priority, "attempt": b.attempt, "run_lease": b.run_lease,
        "max_attempts": b.max_attempts, "run_at": b.run_at, "attempted_at": b.attempted_at,
        "finalized_at": at, "created_at": b.created_at, "unique_key": b.unique_key,
        "unique_states": b.unique_states, "payload": b.payload, "dlq_reason": reason,
        "dlq_at": at, "original_run_lease": orig,
    } for b, reason, orig in items])
