"""Immutable row and value types returned by the storage API."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

from qstore.schema.types import JOB_STATES

__all__ = [
    "BusyCounts",
    "CallbackConfig",
    "CallbackPollKind",
    "CallbackPollResult",
    "ClaimedEntry",
    "ClaimedRuntimeJob",
    "DlqEntry",
    "JobRow",
    "JobState",
    "ListDlqFilter",
    "PruneKind",
    "PruneOutcome",
    "QueueClaimerLease",
    "QueueCounts",
    "RetryFromDlqOpts",
    "RotateKind",
    "RotateOutcome",
    "SkipReason",
    "TerminalDeltaRollupOutcome",
]


class JobState(str, enum.Enum):
    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    RUNNING = "running"
    COMPLETED = "completed"
    RETRYABLE = "retryable"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING_EXTERNAL = "waiting_external"

    @property
    def bit(self) -> int:
        """Bit index in a ``unique_states`` mask (enum declaration order)."""
        return JOB_STATES.index(self.value)


@dataclass(frozen=True)
class JobRow:
    """The public view of one job (STORAGE.md §6.1)."""

    id: int
    kind: str
    queue: str
    args: Any
    state: JobState
    priority: int
    attempt: int
    run_lease: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    heartbeat_at: datetime | None = None
    deadline_at: datetime | None = None
    attempted_at: datetime | None = None
    finalized_at: datetime | None = None
    errors: list[Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    unique_key: bytes | None = None
    unique_states: str | None = None
    callback_id: uuid.UUID | None = None
    callback_timeout_at: datetime | None = None
    callback_filter: str | None = None
    callback_on_complete: str | None = None
    callback_on_fail: str | None = None
    callback_transform: str | None = None
    progress: Any = None


@dataclass(frozen=True)
class ClaimedEntry:
    """Where a claimed attempt lives: enough to close it without re-reading the body."""

    queue: str
    priority: int  # lane priority (join key)
    lane_seq: int
    ready_slot: int
    ready_generation: int
    lease_slot: int
    lease_generation: int
    claim_slot: int
    lease_claim_receipt: bool
    enqueue_shard: int
    job_id: int = 0
    run_lease: int = 0


@dataclass(frozen=True)
class ClaimedRuntimeJob:
    claim: ClaimedEntry
    job: JobRow
    unique_states: str | None = None


_T = TypeVar("_T")


def assemble(cls: type[_T], values: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass ``cls`` holding ``values``, built without running
    its ``__init__``.

    A frozen ``__init__`` pays one ``object.__setattr__`` per field, and the claim path builds
    a ``JobRow`` (27 fields) and a ``ClaimedEntry`` per claimed job; filling ``__dict__`` at
    once costs a fraction of that. ``values`` must name every field exactly once (no
    defaults are applied); the result compares, hashes and prints like one built normally.
    """
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


def field_names(cls: type) -> frozenset[str]:
    """The field names of a dataclass (what :func:`assemble` needs)."""
    return frozenset(f.name for f in fields(cls))


@dataclass(frozen=True)
class QueueClaimerLease:
    claimer_slot: int
    lease_epoch: int


@dataclass(frozen=True)
class QueueCounts:
    available: int = 0
    running: int = 0
    terminal: int = 0


@dataclass(frozen=True)
class BusyCounts:
    queue_ready: int = 0
    queue_done: int = 0
    queue_tombstones: int = 0
    queue_terminal_deltas: int = 0
    leases: int = 0
    claims: int = 0
    closures: int = 0
    queue_claim_ranges: int = 0  # qstore addition: claim-range evidence rows of the slot

    def total(self) -> int:
        """Sum of every field (> 0 ⇔ the slot is not empty)."""
        return (self.queue_ready + self.queue_done + self.queue_tombstones
                + self.queue_terminal_deltas + self.leases + self.claims + self.closures
                + self.queue_claim_ranges)


class SkipReason(str, enum.Enum):
    QUEUE_ACTIVE_LEASES = "queue.active_leases"
    QUEUE_PENDING_READY = "queue.pending_ready"
    QUEUE_OPEN_CLAIMS = "queue.open_claims"
    LEASE_CURRENT = "lease.current"
    LEASE_ACTIVE = "lease.active"
    CLAIM_CURRENT = "claim.current"
    CLAIM_OPEN = "claim.open"

    def as_str(self) -> str:
        return self.value


class OutcomeKind(str, enum.Enum):
    """Base of the kinds of an outcome: a member is its string (it compares and hashes equal
    to it, and ``str()`` / f-strings give the string itself), so a decision can be made on
    the member while code written against the strings keeps working."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RotateKind(OutcomeKind):
    ROTATED = "rotated"
    SKIPPED_BUSY = "skipped_busy"
    SKIPPED_IDLE = "skipped_idle"


class PruneKind(OutcomeKind):
    NOOP = "noop"
    PRUNED = "pruned"
    BLOCKED = "blocked"
    SKIPPED_ACTIVE = "skipped_active"


class CallbackPollKind(OutcomeKind):
    RESOLVED = "resolved"
    PENDING = "pending"
    STALE = "stale"
    UNEXPECTED_STATE = "unexpected_state"
    NOT_FOUND = "not_found"


@dataclass(frozen=True)
class RotateOutcome:
    """``Rotated(slot, generation)``, ``SkippedBusy(slot, busy)`` or ``SkippedIdle(slot, generation)``."""

    kind: RotateKind  # a kind's string is accepted and made the member
    slot: int
    generation: int | None = None
    busy: BusyCounts | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RotateKind(self.kind))

    @classmethod
    def rotated(cls, slot: int, generation: int) -> RotateOutcome:
        return cls(RotateKind.ROTATED, slot, generation)

    @classmethod
    def skipped_busy(cls, slot: int, busy: BusyCounts) -> RotateOutcome:
        return cls(RotateKind.SKIPPED_BUSY, slot, None, busy)

    @classmethod
    def skipped_idle(cls, slot: int, generation: int) -> RotateOutcome:
        """Nothing was written to the current ``slot`` since it was last (re)initialised:
        the ring stays where it is and nothing is written."""
        return cls(RotateKind.SKIPPED_IDLE, slot, generation)


@dataclass(frozen=True)
class PruneOutcome:
    """``Noop`` | ``Pruned(slot)`` | ``Blocked(slot)`` | ``SkippedActive(slot, reason, count)``."""

    kind: PruneKind  # a kind's string is accepted and made the member
    slot: int | None = None
    reason: SkipReason | None = None
    count: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PruneKind(self.kind))

    @classmethod
    def noop(cls) -> PruneOutcome:
        return cls(PruneKind.NOOP)

    @classmethod
    def pruned(cls, slot: int) -> PruneOutcome:
        return cls(PruneKind.PRUNED, slot)

    @classmethod
    def blocked(cls, slot: int) -> PruneOutcome:
        return cls(PruneKind.BLOCKED, slot)

    @classmethod
    def skipped_active(cls, slot: int, reason: SkipReason, count: int) -> PruneOutcome:
        return cls(PruneKind.SKIPPED_ACTIVE, slot, reason, count)


@dataclass(frozen=True)
class TerminalDeltaRollupOutcome:
    rolled_slots: int = 0
    delta_rows: int = 0
    grouped_keys: int = 0
    skipped_active_slots: int = 0
    blocked_slots: int = 0
    skipped_mvcc_pinned: bool = False


@dataclass(frozen=True)
class CallbackConfig:
    filter: str | None = None
    on_complete: str | None = None
    on_fail: str | None = None
    transform: str | None = None


@dataclass(frozen=True)
class CallbackPollResult:
    """``Resolved(payload)`` | ``Pending`` | ``Stale`` | ``UnexpectedState`` | ``NotFound``."""

    kind: CallbackPollKind  # a kind's string is accepted and made the member
    payload: Any = None
    token: uuid.UUID | None = None
    current: uuid.UUID | None = None
    state: JobState | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CallbackPollKind(self.kind))


@dataclass(frozen=True)
class RetryFromDlqOpts:
    run_at: datetime | None = None
    priority: int | None = None
    queue: str | None = None


@dataclass(frozen=True)
class ListDlqFilter:
    kind: str | None = None
    queue: str | None = None
    tag: str | None = None
    before_id: int | None = None
    before_dlq_at: datetime | None = None
    limit: int | None = None


@dataclass(frozen=True)
class DlqEntry:
    """One dead-lettered job: its snapshot (``job``, state failed) and why and when it was
    dead-lettered. ``original_run_lease`` is the attempt that put it there."""

    job: JobRow
    dlq_reason: str
    dlq_at: datetime
    original_run_lease: int
