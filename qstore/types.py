"""The public types: what a caller passes to the storage API and what it gets back.

Inputs: :class:`InsertParams` (with :class:`InsertOpts` and :class:`UniqueOpts`),
:class:`CallbackConfig`, :class:`ListDlqFilter`, :class:`RetryFromDlqOpts`. Results:
:class:`JobRow` (in a :class:`JobState`), :class:`ClaimedRuntimeJob` (a :class:`ClaimedEntry`
and its job), :class:`QueueCounts`, :class:`QueueClaimerLease`, :class:`CallbackPollResult`,
:class:`DlqEntry`, :class:`Wakeup` and the maintenance outcomes (:class:`RotateOutcome`,
:class:`PruneOutcome` with its :class:`SkipReason`, :class:`BusyCounts`,
:class:`TerminalDeltaRollupOutcome`). Every one is exported from :mod:`qstore`; the input
types are checked by the operation that receives them, which raises
:class:`~qstore.errors.ValidationError` naming the bad value.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "BusyCounts",
    "CallbackConfig",
    "CallbackPollKind",
    "CallbackPollResult",
    "ClaimedEntry",
    "ClaimedRuntimeJob",
    "CompletedAndClaimed",
    "DlqEntry",
    "InsertOpts",
    "InsertParams",
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
    "UniqueOpts",
    "Wakeup",
    "WheelPrune",
]


class JobState(str, enum.Enum):
    """A job's state. The declaration order is the order of the database's ``job_state``
    enum and of the bits of a ``unique_states`` mask."""

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
        return _STATE_BITS[self]


_STATE_BITS = {state: i for i, state in enumerate(JobState)}


@dataclass(frozen=True)
class UniqueOpts:
    """Uniqueness: which parts form the key and in which states a job holds it."""

    by_queue: bool = False
    by_args: bool = True
    by_period: int | None = None
    states: int = 0b0001_1111  # scheduled, available, running, completed, retryable


@dataclass(frozen=True)
class InsertOpts:
    """Where and how a new job runs: queue, priority (1 = most urgent .. 4), attempts, a
    future ``run_at`` (the job is scheduled until then), metadata, tags, uniqueness and an
    ordering key (jobs with one key share a lane)."""

    queue: str = "default"
    priority: int = 2
    max_attempts: int = 25
    run_at: datetime | None = None
    deadline_duration: Any = None  # accepted for seed parity; deadlines are per claim call
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tags: Sequence[str] = ()
    unique: UniqueOpts | None = None
    ordering_key: bytes | None = None


@dataclass(frozen=True)
class InsertParams:
    """One job to enqueue: its kind, its JSON args and its options."""

    kind: str
    args: Any = field(default_factory=dict)
    opts: InsertOpts = field(default_factory=InsertOpts)


@dataclass(frozen=True)
class JobRow:
    """The public view of one job."""

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


@dataclass(frozen=True)
class CompletedAndClaimed:
    """What one ``complete_and_claim`` call did: the ``(job_id, run_lease)`` pairs it
    completed, in input order (stale attempts are absent), and the attempts it claimed."""

    completed: list[tuple[int, int]]
    claimed: list[ClaimedRuntimeJob]


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
    progress: int = 0  # qstore addition: heartbeat and progress rows of the slot
    queue_done_batches: int = 0  # qstore addition: batch done rows (completed attempts) of the slot
    closure_batches: int = 0  # qstore addition: batch closures (completed attempts) of the claim slot

    def total(self) -> int:
        """Sum of every field (> 0 ⇔ the slot is not empty)."""
        return (self.queue_ready + self.queue_done + self.queue_tombstones
                + self.queue_terminal_deltas + self.leases + self.claims + self.closures
                + self.queue_claim_ranges + self.progress + self.queue_done_batches + self.closure_batches)


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
class WheelPrune:
    """What one prune of the deferred wheel did: the slots it truncated, the slots left for
    an unresolved entry, and the slots whose lock was not granted in time."""

    pruned: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    blocked: tuple[int, ...] = ()


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


@dataclass(frozen=True)
class Wakeup:
    """What :meth:`Listener.wait <qstore.Listener.wait>` saw.

    ``queues``: logical queues that were notified (new ready work). ``cancels``: attempts
    ``(job_id, run_lease)`` an operator cancelled. ``missed``: notifications may have been
    lost (the connection was re-established): treat every queue as notified. An empty
    wake-up means the timeout passed (or :meth:`Listener.interrupt` was called).
    """

    queues: frozenset[str] = frozenset()
    cancels: tuple[tuple[int, int], ...] = ()
    missed: bool = False

    def __bool__(self) -> bool:
        return bool(self.queues or self.cancels or self.missed)
