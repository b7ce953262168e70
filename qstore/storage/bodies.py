"""The job body as operations carry it between reading and writing.

* :class:`Taken` — a just-finished attempt with its hydrated body (what the execution plane
  hands over when it takes an attempt out of running);
* :class:`Body` — a job's durable body plus where its attempt stood, the input of every
  write of a job's next state (ready, deferred, terminal, DLQ);
* :func:`job_row` — the public :class:`~qstore.types.JobRow` of a body in a given state.

Payload rules: metadata, tags, errors and progress, empty members omitted (an empty payload
is SQL NULL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from qstore.storage.jobs import build_payload
from qstore.types import JobRow, JobState

__all__ = ["Body", "Taken", "error_entry", "job_row"]


@dataclass(frozen=True)
class Taken:
    """A just-finished attempt with its hydrated body."""

    job_id: int
    run_lease: int
    attempt: int
    max_attempts: int
    queue: str
    priority: int  # lane priority
    effective_priority: int
    enqueue_shard: int
    lane_seq: int
    ready_slot: int
    ready_generation: int
    kind: str
    args: Any
    payload: dict[str, Any] | None
    run_at: datetime
    created_at: datetime
    attempted_at: datetime | None
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    unique_key: bytes | None
    unique_states: str | None
    progress: Any
    old_state: JobState

    @property
    def metadata(self) -> dict[str, Any]:
        return dict((self.payload or {}).get("metadata") or {})

    @property
    def tags(self) -> list[str]:
        return list((self.payload or {}).get("tags") or [])

    @property
    def errors(self) -> list[Any]:
        return list((self.payload or {}).get("errors") or [])


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
    def from_ready(cls, row: Any) -> Body:
        """From a ready row (its ring keys kept: a cancelled one gets a done row of its own)."""
        p = row.payload or {}
        return cls(job_id=row.job_id, kind=row.kind, queue=row.queue, args=row.args, priority=row.priority,
                   attempt=row.attempt, run_lease=row.run_lease, max_attempts=row.max_attempts,
                   run_at=row.run_at, created_at=row.created_at, unique_key=row.unique_key,
                   unique_states=row.unique_states, metadata=dict(p.get("metadata") or {}),
                   tags=list(p.get("tags") or []), errors=list(p.get("errors") or []),
                   progress=p.get("progress"), attempted_at=row.attempted_at,
                   ready_slot=row.ready_slot, ready_generation=row.ready_generation,
                   enqueue_shard=row.enqueue_shard, lane_seq=row.lane_seq)

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
