"""Where a job goes next, decided without touching the database.

Ending an attempt flows one way: the execution plane *takes* the attempt
(:func:`qstore.storage.planes.execution.take_attempts`), this module *decides* its
destination (a :class:`Decision`), and :mod:`qstore.storage.destinations` *writes* it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from qstore.storage.bodies import Body
from qstore.storage.planes.execution import Closure
from qstore.types import JobState

__all__ = ["Decision", "Destination", "Outcome", "decide", "exhausted"]


class Destination(enum.Enum):
    """Where a body goes: the deferred backlog, terminal history, the DLQ or the ready ring."""

    DEFERRED = "deferred"
    TERMINAL = "terminal"
    DLQ = "dlq"
    READY = "ready"


@dataclass(frozen=True)
class Decision:
    """A destination and how to get there."""

    destination: Destination
    state: JobState | None = None  # deferred: scheduled/retryable; terminal: completed/failed/cancelled
    delay: timedelta | None = None  # deferred: due after this; None = backoff(attempt)
    reason: str | None = None  # dlq reason
    error: str | None = None  # an error entry with this message
    error_obj: dict[str, Any] | None = None  # a caller-supplied error entry
    terminal_error: bool = False
    attempt: int | None = None  # absolute attempt override (admin retries reset to 0)
    attempt_delta: int = 0  # snooze gives the attempt back
    clear_progress: bool = False
    unique_owner: int | None = None  # the job lost its unique key to this job: it does not take it

    @property
    def new_state(self) -> JobState | None:
        """The job's state once the decision is written."""
        if self.destination is Destination.DEFERRED:
            return self.state or JobState.RETRYABLE
        if self.destination is Destination.DLQ:
            return JobState.FAILED
        if self.destination is Destination.READY:
            return JobState.AVAILABLE
        return self.state


def exhausted(body: Body) -> bool:
    """The attempt was the job's last (``attempt >= max_attempts``)."""
    return body.job.attempt >= body.job.max_attempts


class Outcome(enum.Enum):
    """What a worker reports for a live attempt, and the closure label it writes."""

    RETRY_AFTER = ("retry_after", Closure.RETRYABLE)
    SNOOZE = ("snooze", Closure.SCHEDULED)
    CANCEL = ("cancel_running", Closure.CANCELLED)
    FAIL_TERMINAL = ("fail_terminal", Closure.FAILED)
    FAIL_TO_DLQ = ("fail_to_dlq", Closure.DLQ)
    FAIL_RETRYABLE = ("fail_retryable", Closure.FAILED)

    @property
    def closure(self) -> Closure:
        return self.value[1]


def decide(outcome: Outcome, body: Body, *, dlq_on: bool, delay: timedelta | None = None,
           reason: str | None = None, error: str | None = None) -> Decision:
    """The destination of a live attempt ended with ``outcome``. ``dlq_on``: the job's queue
    sends exhausted jobs to the DLQ."""
    if outcome is Outcome.RETRY_AFTER:
        return Decision(Destination.DEFERRED, JobState.RETRYABLE, delay=delay)
    if outcome is Outcome.SNOOZE:
        return Decision(Destination.DEFERRED, JobState.SCHEDULED, delay=delay, attempt_delta=-1)
    if outcome is Outcome.CANCEL:
        return Decision(Destination.TERMINAL, JobState.CANCELLED, error=f"cancelled: {reason or ''}".rstrip(": "))
    if outcome is Outcome.FAIL_TERMINAL:
        return Decision(Destination.TERMINAL, JobState.FAILED, error=error, terminal_error=True)
    if outcome is Outcome.FAIL_TO_DLQ:
        return Decision(Destination.DLQ, reason=reason, error=error, terminal_error=True)
    if not exhausted(body):
        return Decision(Destination.DEFERRED, JobState.RETRYABLE, error=error)
    if dlq_on:
        return Decision(Destination.DLQ, reason="max_attempts_exhausted", error=error, terminal_error=True)
    return Decision(Destination.TERMINAL, JobState.FAILED, error=error, terminal_error=True)


def rescue_decision(body: Body, *, dlq_on: bool, label: str, error: str) -> Decision:
    """An abandoned attempt (stale heartbeat, passed deadline, timed-out callback): retry
    after backoff, or — when exhausted — failed, or the DLQ when the queue's policy says so."""
    if not exhausted(body):
        return Decision(Destination.DEFERRED, JobState.RETRYABLE, error=error)
    if dlq_on:
        return Decision(Destination.DLQ, reason=label, error=error, terminal_error=True)
    return Decision(Destination.TERMINAL, JobState.FAILED, error=error, terminal_error=True)
