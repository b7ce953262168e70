"""The job body as operations carry it between reading and writing.

* :class:`Body` — a job's durable body (a :class:`~qstore.types.JobRow`) plus, for a job
  taken from the ready ring, where its ready row sits (:class:`ReadyKey`): the input of every
  write of a job's next state (ready, deferred, terminal, DLQ);
* :class:`Taken` — a just-ended attempt: its body and its ready row's payload as stored
  (what the execution plane hands over when it takes an attempt out of running);
* :func:`job_row` — the public :class:`~qstore.types.JobRow` of a body in a given state.

Payload rules: metadata, tags, errors and progress, empty members omitted (an empty payload
is SQL NULL).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from qstore.storage.columns import body_job, evolve
from qstore.storage.jobs import build_payload
from qstore.types import JobRow, JobState

__all__ = ["Body", "ReadyKey", "Taken", "error_entry", "job_row"]


@dataclass(frozen=True)
class ReadyKey:
    """Where a job's ready row sits in the queue ring: the ring slot and generation it was
    written in, its lane's shard and its position in the lane (the lane's queue and priority
    are the job's)."""

    ready_slot: int
    ready_generation: int
    enqueue_shard: int
    lane_seq: int


@dataclass(frozen=True)
class Body:
    """A job's durable body on its way to its next state.

    ``job`` holds the body: what the job was enqueued with (``priority`` is its lane's),
    where its attempts stand, and its metadata, tags, errors and progress; its ``state`` is
    the one it was read in, and the fields of an attempt or a state (heartbeat, deadline,
    finalization, callback) are empty. ``ready`` is where its ready row sits when the body
    was taken from the ready ring (a done row of it then carries the ready row's keys and
    only what changed); None for a body read from a wide snapshot (deferred, DLQ, terminal).
    """

    job: JobRow
    ready: ReadyKey | None = None

    @property
    def payload(self) -> dict[str, Any] | None:
        """The payload a row of this body stores."""
        j = self.job
        return build_payload(j.metadata, j.tags, j.errors, j.progress)

    def replace(self, **changes: Any) -> Body:
        """This body with ``changes`` to its job's fields (the ready key kept)."""
        return Body(evolve(self.job, **changes), self.ready)

    @classmethod
    def from_taken(cls, t: Taken, progress: Any = None) -> Body:
        """The body of a taken attempt; ``progress``, when not None, replaces the attempt's."""
        return t.body if progress is None else t.body.replace(progress=progress)

    @classmethod
    def from_ready(cls, row: Any) -> Body:
        """From a ready row (its ring keys kept: a cancelled one gets a done row of its own)."""
        return cls(body_job(row, JobState.AVAILABLE),
                   ReadyKey(row.ready_slot, row.ready_generation, row.enqueue_shard, row.lane_seq))

    @classmethod
    def from_snapshot(cls, row: Any) -> Body:
        """From a deferred / DLQ / hydrated done row (wide job snapshot)."""
        return cls(body_job(row, JobState(row.state)))


@dataclass(frozen=True)
class Taken:
    """A just-ended attempt: the job's body (its ``state`` the one the attempt was taken out
    of, its progress the attempt's) and the payload its ready row stores (a done row need not
    repeat an equal one)."""

    body: Body
    payload: dict[str, Any] | None

    @property
    def job_id(self) -> int:
        return self.body.job.id

    @property
    def run_lease(self) -> int:
        return self.body.job.run_lease

    @property
    def old_state(self) -> JobState:
        """The state the attempt was taken out of (running or waiting_external)."""
        return self.body.job.state


def error_entry(message: str, attempt: int, at: datetime, *, terminal: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"error": message, "attempt": attempt, "at": at.isoformat()}
    if terminal:
        entry["terminal"] = True
    return entry


def job_row(b: Body, state: JobState, **overrides: Any) -> JobRow:
    """The public row of ``b`` in ``state``, with ``overrides`` set over it; its metadata,
    tags and errors are its own (a caller changing them changes no body)."""
    j = b.job
    return evolve(j, **{"state": state, "metadata": dict(j.metadata), "tags": list(j.tags),
                        "errors": list(j.errors) if j.errors else None, **overrides})
