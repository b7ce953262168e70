"""The worker's decisions, shared by the thread worker and the asyncio worker (sans IO).

Nothing here touches the database, a thread or an event loop. Both workers
(:class:`qstore.runtime.worker.Worker` on threads, :class:`qstore.runtime.aio_worker.AsyncWorker`
on an event loop) hold what they claimed as :class:`Attempt`s in one :class:`WorkerCore`
and ask it what to do:

* :meth:`WorkerCore.plan` turns what a handler returned or raised into the storage write
  it calls for (:class:`Write`), a completion (:data:`COMPLETE`, for the batcher) or
  nothing (the attempt was closed under its handler);
* the *procedures* — :meth:`WorkerCore.finish`, :meth:`WorkerCore.write`,
  :meth:`WorkerCore.give_back`, :meth:`WorkerCore.close_past_deadline`,
  :meth:`WorkerCore.heartbeat` — are generators that yield *effects* and receive their
  results: :class:`Call` (a storage operation: the driver calls it on its storage face and
  sends back the result or throws in the error), :class:`Sleep` (wait, cut short by a stop
  flag; sends back whether the flag is set) and :class:`Probe` (is the schema still
  installed after this error?). :func:`drive` runs one on a synchronous ``QueueStorage``;
  the asyncio worker runs them the same way with ``await``. So retries, backoff, give-backs
  and counting are written once, and a worker only decides how to wait and where to run.
* the rest is bookkeeping: stats (:class:`WorkerStats`), deadlines, heartbeat selection,
  free capacity (:class:`Capacity`), the hand-back of kinds no task handles.

The driver provides a :class:`Host`: the few actions that depend on how it runs (setting a
handler's cancel flag and cancelling its asyncio task, letting an attempt go, handing a
completion to its batcher, stopping on a lost schema).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from qstore.errors import (
    DatabaseError,
    PartialCommitError,
    QueueStorageError,
    SchemaNotInstalledError,
    StaleAttemptError,
    ValidationError,
)
from qstore.outage import OutageLog, describe_failure
from qstore.runtime.maintainer import MaintenanceSchedule
from qstore.runtime.tasks import (
    App,
    Cancel,
    Fail,
    JobContext,
    JobOutcome,
    RetryAfter,
    Snooze,
    Task,
    WaitForCallback,
)
from qstore.status import UNHANDLED_KEY
from qstore.storage.jobs import validate_queue
from qstore.types import ClaimedRuntimeJob, CompletedAndClaimed, JobRow, JobState

__all__ = [
    "COMPLETE",
    "HAND_BACK_CAP",
    "HAND_BACK_FIRST",
    "Attempt",
    "Call",
    "Capacity",
    "ClaimCycles",
    "Flag",
    "Host",
    "Probe",
    "Sleep",
    "Unhandled",
    "WorkerCore",
    "WorkerSettings",
    "WorkerStats",
    "Write",
    "describe_error",
    "drive",
    "unhandled",
]

log = logging.getLogger("qstore.worker")

#: Longest error text a failed attempt records (the message and the raising frame).
MAX_ERROR_CHARS = 2000
#: How long a dispatcher waits for more free handlers before claiming for fewer than half
#: of them (seconds).
CLAIM_LINGER = 0.005
#: How soon a dispatcher whose claim came back partly filled claims again without a
#: notification (seconds; at most ``poll_interval``).
PARTIAL_RECHECK = 0.05
#: How long (seconds) a claim cycle waiting for a notification or for free places keeps its
#: connection: a queue that gets jobs at least this often claims on one connection, without
#: a pool checkout and check-in per claim; a quieter one hands it back to the pool while it
#: waits.
KEEP_IDLE = 0.1
#: Retry delays of an outcome write or a give-back that failed (seconds): the first, doubled
#: after each failure up to the cap. They go on until the attempt's lease ends (see
#: :meth:`WorkerCore.lease_end`) or a stop gives up.
RETRY_FIRST, RETRY_CAP = 0.1, 5.0
#: The part of an attempt's lease that a failing outcome write leaves for giving the attempt
#: back instead: a third of the heartbeat staleness, at most this many seconds.
HAND_BACK_RESERVE = 10.0
#: SQLSTATEs of a statement that named an object which does not exist (schema, table,
#: function): the worker then checks whether its schema is still installed.
MISSING_OBJECT = frozenset({"3F000", "42P01", "42883"})
#: Delay of the n-th hand-back of one job for lack of a task: ``HAND_BACK_FIRST`` seconds
#: doubled for each earlier hand-back the job's progress records, at most ``HAND_BACK_CAP``.
HAND_BACK_FIRST, HAND_BACK_CAP = 1.0, 60.0


# -- settings and stats -------------------------------------------------------------------------


def _number(value: object, name: str, *, minimum: float = 0.0, strict: bool = True,
            integer: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValidationError(name, value, "must be " + ("an integer" if integer else "a finite number"))
    assert isinstance(value, int | float)
    if value < minimum or (strict and value == minimum):
        raise ValidationError(name, value, f"must be {'>' if strict else '>='} {minimum:g}")


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker (:class:`~qstore.runtime.worker.Worker` or
    :class:`~qstore.runtime.aio_worker.AsyncWorker`) runs. Durations are seconds.

    ``queues``: logical queues to work (default: the queues of the app's tasks).
    ``concurrency``: handlers running at once (the sync thread pool's size; async handlers
    count against it too). ``claim_batch``: most attempts one claim call takes (never more
    than the free capacity). ``prefetch``: claimed attempts that may wait for a free handler
    (default: ``concurrency``, so the next claim overlaps the running handlers; 0: claim
    only for free handlers, which lets an idle worker elsewhere take the rest). ``poll_interval``: how long a dispatcher whose queue
    was empty waits before claiming again without a notification. ``listen``: use
    ``LISTEN`` for wake-ups and cancels (off: polling only, and no cancel delivery).
    ``heartbeat_interval``: attempts running longer than this are heartbeated this often
    (keep it well under the maintainer's ``heartbeat_staleness``, 90 s by default).
    ``claim_deadline``: the storage deadline of each attempt (``None``: none; the maintainer
    rescues attempts past it). ``aging_interval``: claim with priority aging.
    ``claims_in_flight``: claim cycles of one queue that may be in flight at once (default
    2). Each cycle is one ``complete_and_claim`` round trip; with 2 the database runs one
    cycle while the worker decodes and dispatches the other. The cycles share the worker's
    places (``concurrency + prefetch``, and what ``claim_ahead`` allows: together they never
    claim more) and the completions waiting in the batcher (each goes out with exactly one
    claim or with the batcher). The first cycle of a queue claims as a single one does (it
    waits for a notification or ``poll_interval`` when the queue runs dry); the others claim
    only while the queue's last claim came back full, so an idle or trickling queue makes no
    more round trips than with 1. Each cycle in flight holds a connection of the engine's
    pool (1 saves a connection per busy queue). With ``max_claimers`` a worker is one claimer
    of its queue and claims one cycle at a time.
    ``claim_ahead``: the most places a claim may take beyond ``concurrency + prefetch``, for
    the attempts the handlers will have let go by the time it comes back (default:
    ``claim_batch``, or 0 when ``prefetch`` is 0; 0: never). The worker measures how many
    attempts its handlers let go per second and how long a claim's round trip takes, and a
    claim takes ahead at most twice what the handlers let go in one round trip
    (:class:`Capacity`). With fast handlers the next claims are then in flight while the
    handlers run the jobs of the last one, each for a full ``claim_batch`` (with 2 cycles
    and the default places each cycle's claim would otherwise take half of them, and the
    database's cost of a claim is mostly per call), instead of the database and the worker
    taking turns; a job claimed ahead waits about two round trips for a handler at most.
    With handlers slower than a round trip per job the worker lets go of less than one
    attempt per round trip, claims nothing ahead, and holds at most ``concurrency +
    prefetch`` attempts, as with 0: slow jobs are not kept from other workers any longer.
    Together these defaults drained no-op jobs about 1.3-1.4 times as fast as one cycle
    without claiming ahead did (one cycle claiming ahead: about 1.1 times). ``claim_batch``
    64 rather than 32 spends about a sixth less of the database's CPU per job of fast
    handlers and drained them 1.1-1.3 times as fast; a claim is never larger than the free
    places, so slow handlers see no difference.
    ``max_claimers``: claim through the queue's bounded claimer slots (at most this many
    claimers per queue across workers) with ``claimer_lease_ttl`` / ``claimer_idle``.
    ``shutdown_timeout``: how long stopping waits for running handlers before giving their
    attempts back. ``completion_batch`` / ``completion_interval``: the batcher's flush size
    and delay. ``maintain``: run a :class:`Maintainer` (with ``schedule``).
    ``error_backoff``: wait after a failed claim.
    ``own_pool``: the worker checks its connections out of a pool of its own, made from
    the engine's (``engine.pool.recreate()``: the same pool class and sizes, except that it
    keeps at least the connections the worker's own threads use at once; connect arguments
    and pool events; the engine's event listeners see the worker's statements), so that its
    many short checkouts neither make the application's pool open and close connections
    nor wait for the application's; the pool is emptied at stop (see
    :mod:`qstore.runtime.pools`). ``False``: the worker uses the engine's own pool, which
    then needs room for the worker's connections beside the application's (a pool that
    cannot hold what the worker keeps, plus one, is refused).
    """

    queues: Sequence[str] | None = None
    concurrency: int = 16
    claim_batch: int = 64
    prefetch: int | None = None
    poll_interval: float = 1.0
    listen: bool = True
    heartbeat_interval: float = 30.0
    claim_deadline: float | None = None
    aging_interval: float | None = None
    claims_in_flight: int = 2
    claim_ahead: int | None = None
    max_claimers: int | None = None
    claimer_lease_ttl: float = 30.0
    claimer_idle: float = 10.0
    shutdown_timeout: float = 30.0
    completion_batch: int = 500
    completion_interval: float = 0.003
    maintain: bool = True
    schedule: MaintenanceSchedule | None = None
    error_backoff: float = 1.0
    own_pool: bool = True

    @property
    def claim_cycles(self) -> int:
        """The claim cycles each queue may have in flight: ``claims_in_flight``, or 1 through
        bounded claimer slots (``max_claimers``): a worker is one claimer of its queue, and
        its claims go through its one slot one at a time."""
        return 1 if self.max_claimers is not None else self.claims_in_flight

    def __post_init__(self) -> None:
        if self.queues is not None:
            if isinstance(self.queues, str):
                raise ValidationError("queues", self.queues, "expected a list of queue names, not one string")
            names = [validate_queue(q, "queues") for q in self.queues]
            if not names:
                raise ValidationError("queues", self.queues, "must name at least one queue (or be None)")
            object.__setattr__(self, "queues", tuple(dict.fromkeys(names)))
        _number(self.concurrency, "concurrency", minimum=1, strict=False, integer=True)
        _number(self.claim_batch, "claim_batch", minimum=1, strict=False, integer=True)
        _number(self.prefetch, "prefetch", strict=False, integer=True, optional=True)
        if self.prefetch is None:  # default: as many claimed jobs waiting as handlers
            object.__setattr__(self, "prefetch", self.concurrency)
        _number(self.claims_in_flight, "claims_in_flight", minimum=1, strict=False, integer=True)
        _number(self.claim_ahead, "claim_ahead", strict=False, integer=True, optional=True)
        if self.claim_ahead is None:  # default: up to one claim's worth, unless prefetch is off
            object.__setattr__(self, "claim_ahead", self.claim_batch if self.prefetch else 0)
        _number(self.max_claimers, "max_claimers", minimum=1, strict=False, integer=True, optional=True)
        _number(self.completion_batch, "completion_batch", minimum=1, strict=False, integer=True)
        for name in ("poll_interval", "heartbeat_interval", "claimer_lease_ttl", "claimer_idle",
                     "completion_interval", "error_backoff"):
            _number(getattr(self, name), name)
        _number(self.shutdown_timeout, "shutdown_timeout", strict=False)
        _number(self.claim_deadline, "claim_deadline", optional=True)
        _number(self.aging_interval, "aging_interval", optional=True)
        if self.schedule is not None and not isinstance(self.schedule, MaintenanceSchedule):
            raise ValidationError("schedule", self.schedule, "expected MaintenanceSchedule or None")
        if not isinstance(self.own_pool, bool):
            raise ValidationError("own_pool", self.own_pool, "expected True or False")
        staleness = (self.schedule or MaintenanceSchedule()).heartbeat_staleness
        if self.heartbeat_interval * 2 > staleness:
            raise ValidationError("heartbeat_interval", self.heartbeat_interval,
                                  f"must be at most half the heartbeat staleness ({staleness:g}s), "
                                  "or running attempts are rescued while they run")


@dataclass(frozen=True)
class WorkerStats:
    """What a worker did so far (a snapshot).

    ``claimed``: attempts claimed; ``completed``: completions committed; ``stale_completions``:
    completions of attempts closed elsewhere first; ``retried``: handler errors that left the
    job retryable; ``failed``: jobs this worker ended ``failed`` other than by
    ``Fail(..., dlq=True)``: ``Fail(error)``, and the ``exhausted`` ones; ``exhausted``: of
    ``failed``, the jobs an error on their last attempt ended (a handler's error, a deadline,
    a refused outcome), which the storage puts in failed history, or in the DLQ when the
    queue's DLQ policy is on (its answer does not say which; ``list_dlq`` does); ``dlq``:
    jobs a handler sent to the DLQ itself (``Fail(..., dlq=True)``; not in ``failed``); ``snoozed``, ``retry_after``, ``cancelled``,
    ``waiting_callback``: those outcomes; ``unknown_kind``: attempts handed back because
    no task of the app has their kind;
    ``closed_under_handler``: attempts closed while their handler ran (operator cancel,
    deadline, give-back), whose result was dropped; ``deadline_exceeded``: attempts closed
    by their task's deadline; ``handed_back``: attempts given back at shutdown;
    ``stale_outcomes``: outcomes of attempts closed elsewhere first; ``outcome_errors``:
    outcomes that could not be written; ``heartbeats``: attempts heartbeated;
    ``claim_calls`` / ``empty_claims`` / ``claim_errors``: claim calls made, those that
    found nothing, those that failed; ``completion_calls``: calls that completed attempts
    (the batcher's, and claims that took completions along); ``followups``: follow-up jobs
    enqueued with completions; ``in_flight``: attempts held now; ``claims_with_completions``:
    of the completion calls, the claims (``complete_and_claim``, one round trip for both).
    """

    claimed: int = 0
    completed: int = 0
    stale_completions: int = 0
    retried: int = 0
    failed: int = 0
    exhausted: int = 0
    dlq: int = 0
    snoozed: int = 0
    retry_after: int = 0
    cancelled: int = 0
    waiting_callback: int = 0
    unknown_kind: int = 0
    closed_under_handler: int = 0
    deadline_exceeded: int = 0
    handed_back: int = 0
    stale_outcomes: int = 0
    outcome_errors: int = 0
    heartbeats: int = 0
    claim_calls: int = 0
    empty_claims: int = 0
    claim_errors: int = 0
    completion_calls: int = 0
    followups: int = 0
    in_flight: int = 0
    claims_with_completions: int = 0


#: The counters a worker keeps itself (the batcher keeps the completion ones).
COUNTERS = [f.name for f in fields(WorkerStats)
            if f.name not in ("completed", "stale_completions", "completion_calls", "claims_with_completions",
                              "followups", "in_flight")]


# -- attempts ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Attempt:
    """One claimed attempt a worker holds, from claim to outcome."""

    claimed: ClaimedRuntimeJob
    ctx: JobContext
    task: Task[Any, Any] | None
    claimed_at: float
    last_beat: float
    started_at: float | None = None
    sent_progress: Any = None
    atask: asyncio.Task[Any] | None = None
    deadline_closed: bool = False
    writing: bool = False  # an outcome write (or give-back) is under way: keep heartbeating
    holds: int = 1  # who still needs the attempt: its handler, and a deadline's closure in flight

    @property
    def pair(self) -> tuple[int, int]:
        return (self.claimed.job.id, self.claimed.job.run_lease)


def describe_error(err: BaseException) -> str:
    """``Type: message (at file:line in function)`` of the frame that raised, cut to
    ``MAX_ERROR_CHARS``."""
    text = f"{type(err).__name__}: {err}".rstrip(": ")
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text[:MAX_ERROR_CHARS]


class Unhandled(JobOutcome):
    """What a worker does with an attempt of a kind it has no task for: give it back
    (``snooze`` for ``seconds``: the attempt does not count) with ``progress`` (the job's
    progress plus the hand-back's record, or None to keep the job's own)."""

    def __init__(self, seconds: float, progress: Any, count: int) -> None:
        self.seconds = seconds
        self.progress = progress
        self.count = count
        super().__init__(f"no task for this kind: handed back for {seconds:g}s")


def unhandled(job: JobRow, now: datetime) -> Unhandled:
    """The hand-back of ``job``'s attempt for lack of a task: the n-th of this job (counted
    in its progress) waits ``HAND_BACK_FIRST * 2**(n-1)`` seconds, at most ``HAND_BACK_CAP``.
    The record goes into the progress when it is empty or a JSON object (the object's other
    keys kept); a progress of another shape is kept as it is, unrecorded."""
    prev = job.progress
    mark = prev.get(UNHANDLED_KEY) if isinstance(prev, dict) else None
    before = mark.get("count") if isinstance(mark, dict) else None
    count = (before if isinstance(before, int) and not isinstance(before, bool) and before > 0 else 0) + 1
    seconds = min(HAND_BACK_FIRST * 2 ** min(count - 1, 32), HAND_BACK_CAP)
    progress: Any = None
    if prev is None or isinstance(prev, dict):
        progress = {**(prev or {}), UNHANDLED_KEY: {"count": count, "run_lease": job.run_lease,
                                                    "at": now.isoformat()}}
    return Unhandled(seconds, progress, count)


# -- effects -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Call the storage operation ``op`` with the worker's engine and ``args``: the driver
    sends back its result, or throws its exception into the procedure."""

    op: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds``, cut short when the stop flag ``until`` (``"give_up"`` or
    ``"hurry"``) is set; the driver sends back whether it is set."""

    seconds: float
    until: str


@dataclass(frozen=True)
class Probe:
    """Whether ``err`` means the schema is no longer installed: the driver sends back the
    :class:`SchemaNotInstalledError` to stop with, or None."""

    err: BaseException


Effect = Call | Sleep | Probe
#: A procedure: yields effects, receives their results, returns its own.
Procedure = Generator[Effect, Any, Any]


def drive(proc: Procedure, storage: Any, engine: Any, *, wait: Callable[[Sleep], bool],
          probe: Callable[[BaseException], SchemaNotInstalledError | None]) -> Any:
    """Run ``proc`` to its end on a synchronous storage face: each :class:`Call` on
    ``storage`` with ``engine``, each :class:`Sleep` through ``wait``, each :class:`Probe`
    through ``probe``; returns what ``proc`` returns."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = proc.throw(error) if error is not None else proc.send(value)
        except StopIteration as done:
            return done.value
        value, error = None, None
        try:
            if isinstance(effect, Call):
                value = getattr(storage, effect.op)(engine, *effect.args, **dict(effect.kwargs))
            elif isinstance(effect, Sleep):
                value = wait(effect)
            else:
                value = probe(effect.err)
        except Exception as err:
            error = err


def schema_error(err: BaseException) -> SchemaNotInstalledError | bool | None:
    """What ``err`` says about the schema without a probe: the error itself when it is a
    :class:`SchemaNotInstalledError`, None when it cannot mean the schema is gone, True
    when a probe must tell (a statement named an object that does not exist)."""
    if isinstance(err, SchemaNotInstalledError):
        return err
    if getattr(err, "sqlstate", None) not in MISSING_OBJECT:
        return None
    return True


# -- decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Write:
    """The storage write that ends an attempt: ``op`` with ``args`` after ``(job_id,
    run_lease)``, named ``name`` in the log; ``counter`` is counted when it lands (``end``:
    counted by where the job went, :meth:`WorkerCore.count_end`)."""

    name: str
    op: str
    args: tuple[Any, ...]
    counter: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()


class _Complete:
    def __repr__(self) -> str:
        return "COMPLETE"


#: :meth:`WorkerCore.plan`: the attempt completes (through the batcher).
COMPLETE = _Complete()
END = "end"  # a Write's counter: count by the job's new state

#: A Write's counter -> the outcome the app's telemetry records (``ended``).
TELEMETRY_OUTCOMES = {"snoozed": "snoozed", "retry_after": "retried", "cancelled": "cancelled",
                      "dlq": "dlq", "failed": "failed", "waiting_callback": "waiting"}


def _ignore(value: Any) -> None:
    """The outcome observer when no telemetry records."""


class Lender(Protocol):
    """What a claim that takes completions along needs of the batcher that lent them."""

    def settle_lent(self, lent: Sequence[Any], done: Sequence[tuple[int, int]]) -> None: ...

    def return_lent(self, lent: Sequence[Any]) -> None: ...


class Host(Protocol):
    """What a worker does for the core that depends on how it runs."""

    def close_under_handler(self, a: Attempt, reason: str) -> None:
        """Set the handler's cancel flag (and cancel its asyncio task)."""

    def forget(self, a: Attempt) -> None:
        """One holder of ``a`` is done with it (see :meth:`WorkerCore.release`)."""

    def complete(self, a: Attempt) -> None:
        """Hand ``a`` to the completion batcher."""

    def fatal(self, err: SchemaNotInstalledError) -> None:
        """Stop the worker: its schema is gone."""


class IdleGiveBack:
    """When a claim cycle waiting for free places hands its kept connection back: once the
    wait has lasted :data:`KEEP_IDLE` (short waits of a drain keep it). One per wait."""

    __slots__ = ("_pending", "_since")

    def __init__(self, pending: bool) -> None:
        self._pending = pending  # False: nothing to hand back
        self._since: float | None = None

    def step(self, now: float, wait: float) -> tuple[float, bool]:
        """Before waiting ``wait`` seconds at ``now``: (how long to wait, whether to hand
        the connection back first). Until it is handed back, no wait outlasts
        :data:`KEEP_IDLE`, so the hand-back comes on time."""
        if not self._pending:
            return wait, False
        if self._since is None:
            self._since = now
        elif now - self._since >= KEEP_IDLE:
            self._pending = False
            return wait, True
        return min(wait, KEEP_IDLE), False


class Capacity:
    """A worker's places: ``concurrency`` handlers plus ``prefetch`` claimed attempts
    waiting for one, shared by every claim cycle of the worker (a cycle reserves places
    before it claims and gives back those its claim did not fill). Not thread-safe by
    itself: the thread worker calls it under its lock.

    ``cycles``: the claim cycles that may be in flight at once per queue. One claim takes
    at most a ``cycles``-th of the places (its :attr:`share`, rounded up), and the floor a
    claim waits for (see :meth:`take`) is half the places, or a ``cycles``-th of them when
    that is less: each of the cycles can have a claim in flight, and no cycle's claim takes
    the places of the others.

    ``ahead``: the most places a claim may take beyond the total (``claim_ahead``): the
    places of attempts the handlers are expected to finish while that claim is in flight.
    The worker reports each claim's round trip and each attempt it let go (:meth:`landed`,
    :meth:`release`); from them :attr:`ahead_now` is twice the attempts the handlers let go
    per claim round trip lately (their rate times the round trip), at most ``ahead``. Fast
    handlers then have the next claim in flight while they run the last one's jobs, and a
    job claimed ahead waits about two round trips for a handler at most; slow handlers let
    go of less than one attempt per round trip, and the worker claims exactly as without
    ``ahead``."""

    #: How much of a new measurement the rate and round-trip estimates take in (the rest
    #: is their previous value).
    SMOOTHING = 0.5
    #: How many round trips' worth of the handlers' rate a claim may take ahead.
    AHEAD_TRIPS = 2.0

    def __init__(self, total: int, cycles: int = 1, ahead: int = 0) -> None:
        self.total = total
        self.free = total  # places of the total not held or reserved (below 0 when ahead is in use)
        self.share = max(1, -(-total // cycles))
        self.floor = max(1, total // max(2, cycles))
        self.ahead = ahead
        self.ahead_now = 0
        self._let_go = 0  # attempts let go since the last measurement
        self._since: float | None = None
        self.rate = 0.0  # attempts let go per second (smoothed)
        self.rtt = 0.0  # a claim's round trip (smoothed, seconds)

    @property
    def available(self) -> int:
        """Places a claim may take now: the free ones and those it may take ahead."""
        return self.free + self.ahead_now

    def reset(self, held: int, now: float | None = None) -> None:
        """Start over with ``held`` places held (a worker's start): no estimate, nothing ahead."""
        self.free = self.total - held
        self.ahead_now = 0
        self._let_go = 0
        self._since = now
        self.rate = self.rtt = 0.0

    def take(self, most: int, free_since: float | None, now: float) -> tuple[int, float | None, float | None]:
        """One step of reserving up to ``most`` places: ``(n, 0, None)`` when ``n`` places
        were taken; otherwise ``(0, wait, free_since)``: wait up to ``wait`` seconds (None:
        until a release) and ask again. A claim waits until half the places (or ``most``)
        are free, or one place has been free for ``CLAIM_LINGER`` seconds: one claim of many
        jobs instead of many claims of one. Never more than :attr:`share` (plus the places
        it may take ahead)."""
        most = min(most, self.share + self.ahead_now)
        enough = min(most, self.floor)
        free = self.available
        if free >= enough:
            n = min(most, free)
            self.free -= n
            return n, 0.0, None
        if free <= 0:
            return 0, None, None
        if free_since is None:
            return 0, CLAIM_LINGER, now
        if now - free_since >= CLAIM_LINGER:
            n = min(most, free)
            self.free -= n
            return n, 0.0, None
        return 0, CLAIM_LINGER - (now - free_since), free_since

    def release(self, n: int, idle: bool, let_go: bool = False) -> bool:
        """Give ``n`` places back (``let_go``: of attempts the worker let go, counted for the
        handlers' rate; otherwise a claim's unfilled reservation); True when a waiting claim
        should be woken (the worker had none available, crossed the half-way mark, or holds
        nothing: ``idle``)."""
        was = self.available
        self.free += n
        if let_go:
            self._let_go += n
        now = self.available
        return was <= 0 or now >= self.floor > was or idle

    def landed(self, rtt: float, now: float) -> bool:
        """A claim came back after ``rtt`` seconds: update the handlers' rate (attempts let
        go since the last claim came back, per second), the round trip, and
        :attr:`ahead_now`; True when more places became available (wake a waiting claim)."""
        if self.ahead <= 0:
            return False
        k = self.SMOOTHING
        self.rtt = rtt if self.rtt == 0.0 else k * rtt + (1 - k) * self.rtt
        if self._since is not None and now > self._since:
            sample = self._let_go / (now - self._since)
            self.rate = k * sample + (1 - k) * self.rate
        self._let_go = 0
        self._since = now
        was = self.ahead_now
        self.ahead_now = min(self.ahead, int(self.AHEAD_TRIPS * self.rate * self.rtt))
        return self.ahead_now > was and self.available > 0


class Flag(Protocol):
    """An event a worker signals with (``threading.Event`` or ``asyncio.Event``)."""

    def set(self) -> None: ...

    def clear(self) -> None: ...


class ClaimCycles:
    """How the claim cycles of one queue take turns (see ``claims_in_flight`` in
    :class:`WorkerSettings`): ``n`` cycles, numbered from 0, may each have one claim in flight.

    Cycle 0, the *lead*, claims as a lone dispatcher does: at once while its claims come
    back full, else after a notification or its poll. The other cycles claim only while the
    queue is :attr:`busy`: its latest claim to return came back full (it filled every place
    it asked for, so more is likely waiting). A claim that comes back short or fails makes
    the queue quiet, and the other cycles then wait for the next full claim, so an idle or
    trickling queue has one cycle that claims, as with ``n`` = 1. Not thread-safe by
    itself: the thread worker calls it under its lock."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy = False

    @staticmethod
    def name(queue: str, index: int) -> str:
        """The name of cycle ``index`` of ``queue`` (to the batcher's ``expect_claims`` and
        in thread and task names): the queue's own for the lead."""
        return queue if index == 0 else f"{queue}#{index}"

    def may_claim(self, index: int) -> bool:
        """Whether cycle ``index`` may claim now: the lead always, the others while busy."""
        return index == 0 or self.busy

    def returned(self, want: int, got: int) -> bool:
        """A claim for ``want`` places returned ``got`` attempts (0 for a claim that failed);
        True when this made a quiet queue busy (wake the other cycles, the lead included)."""
        was, self.busy = self.busy, got >= want > 0
        return self.busy and not was

    def signal(self, index: int, want: int, got: int, *, claiming: bool, busy: Flag, wake: Flag) -> None:
        """Record how a claim of cycle ``index`` went (see :meth:`returned`) and signal the
        queue's other cycles through its events: ``busy`` is set while the queue is busy
        (the extra cycles claim) and cleared when it went quiet (unless the worker is
        stopping, which keeps it set so they see the stop); ``wake`` wakes the lead, which
        may be waiting after a short claim, when another cycle's claim made the queue busy."""
        became = self.returned(want, got)
        if self.n == 1:
            return
        if self.busy:
            busy.set()
            if became and index != 0:
                wake.set()
        elif claiming:
            busy.clear()


def worker_inputs(app: App, settings: WorkerSettings | None) -> tuple[WorkerSettings, tuple[str, ...]]:
    """A worker's ``settings`` (the defaults for None) and the queues it works (the
    settings' ``queues``, else the app's), after checking both; ``ValidationError`` names
    what is wrong."""
    if not isinstance(app, App):
        raise ValidationError("app", app, "expected qstore.tasks.App")
    if settings is not None and not isinstance(settings, WorkerSettings):
        raise ValidationError("settings", settings, "expected WorkerSettings or None")
    settings = settings or WorkerSettings()
    queues = settings.queues if settings.queues is not None else app.queues
    if not queues:
        raise ValidationError("queues", list(queues), "no queue to work: register a task or name queues")
    return settings, tuple(queues)


class WorkerCore:
    """The attempts a worker holds, its counters, and every decision about them (see the
    module docstring). ``lock`` guards the attempts and counters (the thread worker passes
    its own, which also guards its capacity)."""

    def __init__(self, app: App, settings: WorkerSettings, host: Host, outages: OutageLog,
                 flags: dict[str, Any], lock: threading.Lock | None = None) -> None:
        self.app = app
        self.settings = settings
        self.host = host
        self.outages = outages
        self.flags = flags  # "give_up", "hurry": objects with is_set()
        self.lock = lock or threading.Lock()
        self.attempts: dict[tuple[int, int], Attempt] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.staleness = (settings.schedule or MaintenanceSchedule()).heartbeat_staleness
        self.unhandled_kinds: set[str] = set()  # kinds whose hand-back was logged

    # -- counters ---------------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def stats(self, completed: int, stale: int, calls: int, followups: int, with_claims: int = 0) -> WorkerStats:
        with self.lock:
            counts = dict(self.counts)
            in_flight = len(self.attempts)
        return WorkerStats(**counts, completed=completed, stale_completions=stale,
                           completion_calls=calls, claims_with_completions=with_claims,
                           followups=followups, in_flight=in_flight)

    def count_end(self, row: JobRow, job: JobRow) -> None:
        """Count an error's end of ``job``: retried, or failed for good (exhausted)."""
        if row.state is JobState.RETRYABLE:
            self.count("retried")
        else:  # exhausted: failed history, or the DLQ when the queue's policy says so
            self.count("failed")
            self.count("exhausted")
            log.warning("qstore worker: job %s (%s) failed for good after attempt %d", job.id, job.kind,
                        job.attempt)

    # -- claiming ---------------------------------------------------------------------------------
    @property
    def cycles(self) -> int:
        """The claim cycles each queue may have in flight (:attr:`WorkerSettings.claim_cycles`)."""
        return self.settings.claim_cycles

    @property
    def claims_complete(self) -> bool:
        """Whether a claim can take completions along (``complete_and_claim``): not through
        bounded claimer slots (``max_claimers``), whose claim has no completing form."""
        return self.settings.max_claimers is None

    def claim_call(self, queue: str, n: int, instance_id: Any,
                   completions: Sequence[ClaimedRuntimeJob] = ()) -> Call:
        """The claim of up to ``n`` attempts of ``queue`` the settings call for; with
        ``completions`` (only when :attr:`claims_complete`), the one call that completes
        them and claims: ``complete_and_claim``, whose result is a ``CompletedAndClaimed``
        (see :meth:`claim_result`)."""
        s = self.settings
        deadline = timedelta(seconds=s.claim_deadline or 0)
        aging = timedelta(seconds=s.aging_interval or 0)
        if completions:
            if not self.claims_complete:
                raise ValueError("claims through claimer slots cannot take completions along")
            return Call("complete_and_claim", (completions, queue, n, deadline, aging))
        if s.max_claimers is not None:
            return Call("claim_runtime_batch_with_aging_for_instance",
                        (queue, n, deadline, aging, instance_id, s.max_claimers, s.claimer_lease_ttl,
                         s.claimer_idle))
        if s.aging_interval is not None:
            return Call("claim_runtime_batch_with_aging", (queue, n, deadline, aging))
        return Call("claim_runtime_batch", (queue, n, deadline))

    @staticmethod
    def claim_result(result: Any) -> tuple[list[ClaimedRuntimeJob], list[tuple[int, int]]]:
        """What a :meth:`claim_call` returned, as ``(claimed jobs, completed pairs)``."""
        if isinstance(result, CompletedAndClaimed):
            return result.claimed, result.completed
        return result, []

    @staticmethod
    def partly_committed(err: PartialCommitError) -> tuple[list[ClaimedRuntimeJob], list[tuple[int, int]]]:
        """What a ``complete_and_claim`` that raised ``err`` committed: ``(claimed jobs,
        completed pairs)`` (its claim and first completion committed; work on those jobs)."""
        jobs = [x for x in err.committed if isinstance(x, ClaimedRuntimeJob)]
        return jobs, [x for x in err.committed if not isinstance(x, ClaimedRuntimeJob)]

    def claim_returned(self, lender: Lender, lent: Sequence[Any], result: Any) -> list[ClaimedRuntimeJob]:
        """After a :meth:`claim_call` that took ``lent`` completions along returned
        ``result``: the completions it settled are settled with ``lender`` (the batcher);
        returns the claimed jobs."""
        jobs, done = self.claim_result(result)
        if lent:
            lender.settle_lent(lent, done)
        return jobs

    def claim_raised(self, lender: Lender, lent: Sequence[Any], err: BaseException) -> list[ClaimedRuntimeJob]:
        """After a :meth:`claim_call` that took ``lent`` completions along raised ``err``:
        a partial commit settles what committed, gives the rest back to ``lender`` and
        returns the jobs it claimed; any other failure gives every lent completion back (the
        batcher sends them, with its retries) and raises ``err`` again."""
        if lent and isinstance(err, PartialCommitError):
            jobs, done = self.partly_committed(err)
            left = set(err.pending)
            lender.settle_lent([c for c in lent if c.pair not in left], done)
            lender.return_lent([c for c in lent if c.pair in left])
            return jobs
        if lent:
            lender.return_lent(lent)
        raise err

    def claimed(self, jobs: Sequence[ClaimedRuntimeJob], context: Callable[[ClaimedRuntimeJob], JobContext],
                now: float) -> list[Attempt]:
        """Hold the attempts of one claim call (counted), each with its task (None: no task
        has its kind) and a context from ``context``."""
        out = self.attempts_of(jobs, context, now)
        with self.lock:
            self.hold(out)
        return out

    def attempts_of(self, jobs: Sequence[ClaimedRuntimeJob], context: Callable[[ClaimedRuntimeJob], JobContext],
                    now: float) -> list[Attempt]:
        """The attempts of one claim call, each with its task (None: no task has its kind)
        and a context from ``context``; not held yet (see :meth:`hold`)."""
        task = self.app.get
        return [Attempt(j, context(j), task(j.job.kind), now, now) for j in jobs]

    def hold(self, attempts: Sequence[Attempt]) -> None:
        """Hold the ``attempts`` of one claim call and count the call; the caller holds
        :attr:`lock` (the thread worker settles the claim's places in the same critical
        section)."""
        counts = self.counts
        counts["claim_calls"] += 1
        counts["claimed"] += len(attempts)
        if not attempts:
            counts["empty_claims"] += 1
        held = self.attempts
        for a in attempts:
            held[a.pair] = a

    def release(self, a: Attempt) -> bool:
        """One holder of ``a`` lets it go; True when it was the last (the attempt is no
        longer held and its place is free)."""
        with self.lock:
            return self.let_go(a)

    def let_go(self, a: Attempt) -> bool:
        """:meth:`release` for a caller that holds :attr:`lock` already (the thread worker
        frees the attempt's place in the same critical section)."""
        a.holds -= 1
        if a.holds > 0:
            return False
        return self.attempts.pop(a.pair, None) is not None

    def waiting(self) -> list[Attempt]:
        """Attempts claimed whose handler has not started."""
        with self.lock:
            return [a for a in self.attempts.values() if a.started_at is None]

    def held(self) -> list[Attempt]:
        with self.lock:
            return list(self.attempts.values())

    def get(self, pair: tuple[int, int]) -> Attempt | None:
        with self.lock:
            return self.attempts.get(pair)

    # -- what a handler produced --------------------------------------------------------------
    def unknown(self, a: Attempt) -> Unhandled:
        """The hand-back of an attempt whose kind no task of the app has, logged once per
        kind (WARNING)."""
        job = a.claimed.job
        with self.lock:
            first = job.kind not in self.unhandled_kinds
            self.unhandled_kinds.add(job.kind)
        if first:
            log.warning("qstore worker: no task for kind %r (queue %r): handing its jobs back for a worker "
                        "that has one (snooze with backoff, the attempt not counted); known kinds: %s",
                        job.kind, job.queue, ", ".join(sorted(self.app.tasks)) or "none")
        return unhandled(job, datetime.now(timezone.utc))

    @staticmethod
    def sync_result(a: Attempt, value: Any) -> Any:
        """What a sync handler returned, as an outcome: an awaitable (the function was not
        declared ``async def``) is closed and becomes a TypeError."""
        if hasattr(value, "__await__"):
            close = getattr(value, "close", None)
            if close is not None:
                close()
            assert a.task is not None
            return TypeError(f"task {a.task.kind!r} is not declared async but returned an "
                             "awaitable; declare it with async def")
        return value

    @staticmethod
    def writes(a: Attempt, outcome: Any) -> bool:
        """Whether finishing ``a`` with ``outcome`` calls the database right away (a
        completion only goes to the batcher)."""
        return not a.ctx.is_cancelled and isinstance(outcome, BaseException)

    def plan(self, a: Attempt, outcome: Any) -> Write | _Complete:
        """The storage write (or the completion) that ``outcome`` of ``a``'s handler calls
        for; progress the handler recorded goes with it."""
        job = a.claimed.job
        p = a.ctx.progress
        if isinstance(outcome, JobOutcome):
            o = outcome
            if isinstance(o, Snooze):
                return Write("snooze", "snooze", (o.seconds, p), "snoozed")
            if isinstance(o, RetryAfter):
                return Write("retry_after", "retry_after", (o.seconds, p), "retry_after")
            if isinstance(o, Cancel):
                return Write("cancel_running", "cancel_running", (o.reason, p), "cancelled")
            if isinstance(o, Fail):
                if o.dlq:
                    return Write("fail_to_dlq", "fail_to_dlq", (o.dlq_reason, o.error, p), "dlq")
                return Write("fail_terminal", "fail_terminal", (o.error, p), "failed")
            if isinstance(o, WaitForCallback):
                return Write("wait_for_callback", "wait_for_callback", (o.timeout,), "waiting_callback",
                             kwargs=(("callback_id", o.callback_id),))
            if isinstance(o, Unhandled):
                return Write("snooze (no task for its kind)", "snooze", (o.seconds, o.progress), "unknown_kind")
            # a JobOutcome subclass of the application's own: treat as an error
            return self.plan(a, TypeError(f"unsupported outcome {type(o).__name__}"))
        if isinstance(outcome, BaseException):
            error = describe_error(outcome)
            log.debug("qstore worker: job %s (%s) attempt %d raised %s", job.id, job.kind, job.attempt,
                      error, exc_info=outcome)
            return Write("fail_retryable", "fail_retryable", (error, p), END)
        return COMPLETE

    def finish_plain(self, a: Attempt, outcome: Any) -> bool:
        """Finish ``a`` at once when ``outcome`` is a plain return value of a live attempt:
        its completion goes to the batcher, it is let go, and True is returned (what
        :meth:`finish` does then, without running a procedure). False: nothing was done,
        run :meth:`finish`."""
        if isinstance(outcome, BaseException) or a.ctx.is_cancelled:
            return False
        try:
            self.host.complete(a)
        finally:
            self.host.forget(a)
        return True

    # -- procedures ---------------------------------------------------------------------------
    def finish(self, a: Attempt, outcome: Any) -> Procedure:
        """Apply what the handler produced to its attempt, then let the attempt go."""
        try:
            if a.ctx.is_cancelled:
                self.count("closed_under_handler")
                log.debug("qstore worker: job %s: attempt closed while its handler ran (%s); "
                          "result dropped", a.pair[0], a.ctx.cancel_reason)
            else:
                step = self.plan(a, outcome)
                if isinstance(step, Write):
                    yield from self.write(a, step)
                else:
                    self.host.complete(a)
        except Exception:  # a bug: the attempt must not stay running behind the worker's back
            self.count("outcome_errors")
            log.exception("qstore worker: job %s: outcome could not be applied; giving the attempt back",
                          a.pair[0])
            yield from self.give_back([a], "outcome could not be applied", until_lease=True)
        finally:
            self.host.forget(a)

    def lease_end(self, a: Attempt) -> float:
        """When ``a`` counts as abandoned (``time.monotonic()``): its last heartbeat (or its
        claim) plus the heartbeat staleness, or its storage deadline if that comes first."""
        end = a.last_beat + self.staleness
        if self.settings.claim_deadline is not None:
            end = min(end, a.claimed_at + self.settings.claim_deadline)
        return end

    def write(self, a: Attempt, w: Write, *, fallback: bool = True, now: Callable[[], float] | None = None
              ) -> Procedure:
        """Run the write ``w`` of ``a`` until it lands; returns its result, or None
        (counted stale) when the attempt was closed elsewhere first. Counts ``w.counter``.

        A database error is retried with a growing delay (``RETRY_FIRST`` doubled up to
        ``RETRY_CAP``) until a reserve before the attempt's lease ends (a third of the heartbeat
        staleness, at most ``HAND_BACK_RESERVE`` seconds), or until a stop gives up; the
        attempt is then given back (``snooze`` 0 s, retried until its lease ends). A call
        refused for another reason (a bad value in the outcome) ends the attempt
        ``fail_retryable`` with the refusal instead (``fallback``; a give-back would run the
        same handler again at once, and again), and is given back if that is refused too.
        Returns None in those cases. The attempt is heartbeated meanwhile."""
        clock = now or time.monotonic
        job = a.claimed.job
        name = w.name
        what = "outcome writes"
        until = self.lease_end(a) - min(self.staleness / 3, HAND_BACK_RESERVE)
        delay = RETRY_FIRST
        a.writing = True
        try:
            while True:
                try:
                    result = yield Call(w.op, (job.id, job.run_lease, *w.args), w.kwargs)
                except StaleAttemptError:
                    result = None  # the attempt was closed meanwhile (e.g. before its callback registered)
                except ValidationError as err:
                    return (yield from self._refused(a, name, err, fallback=fallback))
                except DatabaseError as err:
                    gone = yield Probe(err)
                    if gone is not None:
                        self.outages.forget(what, key=a.pair)
                        self.host.fatal(gone)
                        return None
                    wait = min(delay, until - clock())
                    if wait <= 0 or self.flags["give_up"].is_set() or self.flags["hurry"].is_set():
                        self.outages.failed(what, err, None, key=a.pair,
                                            detail=f"job {job.id}: {name}, giving the attempt back")
                        self.outages.forget(what, key=a.pair)
                        self.count("outcome_errors")
                        yield from self.give_back([a], f"{name} could not be written", until_lease=True)
                        return None
                    self.outages.failed(what, err, wait, key=a.pair, detail=f"job {job.id}: {name}")
                    yield Sleep(wait, "give_up")
                    delay = min(delay * 2, RETRY_CAP)
                    continue
                except Exception as err:  # refused (a QueueStorageError), or a bug (logged with its traceback)
                    return (yield from self._refused(a, name, err, fallback=fallback))
                self.outages.ok(what, key=a.pair)
                break
        finally:
            a.writing = False
        if result is None or result is False:
            self.count("stale_outcomes")
            log.debug("qstore worker: job %s: outcome of a closed attempt ignored", job.id)
            return None
        if w.counter == END:
            self.count_end(result, job)
        elif w.counter is not None:
            self.count(w.counter)
        self._observe_end(job, w.counter, result)
        return result

    def _observe_end(self, job: JobRow, counter: str | None, row: Any) -> None:
        """Tell the app's telemetry how the attempt of ``job`` ended (a write landed)."""
        telemetry = self.app.telemetry
        if not telemetry.enabled or not telemetry.recording:
            return
        if counter == END:
            name: str | None = "retried" if getattr(row, "state", None) is JobState.RETRYABLE else "failed"
        else:
            name = TELEMETRY_OUTCOMES.get(counter or "")
        if name is not None:
            telemetry.ended(job, name)

    def observe_completed(self, jobs: Sequence[JobRow]) -> None:
        """Tell the app's telemetry that the attempts of ``jobs`` completed (the batcher
        calls it once their completion committed)."""
        if not self.app.telemetry.recording:
            return
        for job in jobs:
            self.app.telemetry.ended(job, "completed")

    @contextmanager
    def observed(self, a: Attempt) -> Iterator[Callable[[Any], None]]:
        """Around one run of ``a``'s handler: the app's telemetry records its start, pickup
        latency, run time and span. Call the yielded function with what the handler
        returned or raised: an error or a ``Fail`` marks the span failed."""
        telemetry = self.app.telemetry
        if not telemetry.enabled or not telemetry.recording:
            yield _ignore
            return
        with telemetry.attempt(a.claimed.job) as record:
            def outcome(value: Any) -> None:
                if isinstance(value, Fail):
                    record.failed(value.error if isinstance(value.error, str) else repr(value.error))
                elif isinstance(value, BaseException) and not isinstance(value, JobOutcome):
                    record.failed(value)

            yield outcome

    def _refused(self, a: Attempt, name: str, err: Exception, *, fallback: bool) -> Procedure:
        """``name`` of ``a`` failed for a reason a retry cannot fix: say so, then end the
        attempt ``fail_retryable`` with the reason (``fallback``) or give it back."""
        self.count("outcome_errors")
        text, sqlstate = describe_failure(err)
        then = "failing the attempt with the reason" if fallback else "giving the attempt back"
        log.warning("qstore worker: job %s: %s refused (%s): %s; %s", a.pair[0], name,
                    f"SQLSTATE {sqlstate}" if sqlstate else "no SQLSTATE", text, then,
                    exc_info=None if isinstance(err, QueueStorageError) else err)
        if not fallback:
            yield from self.give_back([a], f"{name} refused", until_lease=True)
            return None
        message = f"the outcome {name} was refused: {text}"[:MAX_ERROR_CHARS]
        yield from self.write(a, Write("fail_retryable", "fail_retryable", (message,), END), fallback=False)
        return None

    def give_back(self, attempts: list[Attempt], reason: str, *, until_lease: bool = False,
                  now: Callable[[], float] | None = None) -> Procedure:
        """Hand ``attempts`` back to the queue (``snooze`` 0 s: due at once, the attempt does
        not count); their handlers, if running, see ``ctx.cancelled``.

        A database error is retried (``RETRY_FIRST`` doubled up to ``RETRY_CAP``) until the
        attempt's lease ends or a hurried stop. With ``until_lease`` (an outcome write that
        gave up) the retries also end when a stop gives up: the stop holds the attempt too and
        gives it back itself. An attempt that cannot be given back is logged; the maintainer
        rescues it once its heartbeat is stale."""
        clock = now or time.monotonic
        what = "give-backs"
        for a in attempts:
            self.host.close_under_handler(a, reason)
        ends = "give_up" if until_lease else "hurry"
        pending, delay = list(attempts), RETRY_FIRST
        while pending:
            failed = yield from self._snooze_back(pending)
            if not failed:
                return None
            t = clock()
            over = self.flags[ends].is_set() or self.flags["hurry"].is_set()
            retry = [] if over else [(a, err) for a, err in failed if self.lease_end(a) > t]
            kept = {id(a) for a, _ in retry}
            for a, err in failed:
                if id(a) in kept:
                    continue
                if until_lease and self.flags["give_up"].is_set() and not self.flags["hurry"].is_set():
                    a.writing = False
                    continue  # the stop gives it back
                self.outages.failed(what, err, None, key=a.pair,
                                    detail=f"job {a.pair[0]} not given back; the maintainer rescues it "
                                           "once its heartbeat is stale")
                self.outages.forget(what, key=a.pair)
                self._handed_back(a, None)
            if not retry:
                return None
            wait = max(0.0, min(delay, *(self.lease_end(a) - t for a, _ in retry)))
            for a, err in retry:
                self.outages.failed(what, err, wait, key=a.pair, detail=f"job {a.pair[0]}")
            yield Sleep(wait, ends)
            delay = min(delay * 2, RETRY_CAP)
            pending = [a for a, _ in retry]
        return None

    def _snooze_back(self, attempts: list[Attempt]) -> Procedure:
        """One ``snooze(0)`` of each attempt; returns those that met a database error."""
        failed = []
        for a in attempts:
            job = a.claimed.job
            a.writing = True
            try:
                row = yield Call("snooze", (job.id, job.run_lease, 0))
            except DatabaseError as err:
                failed.append((a, err))
                continue
            except QueueStorageError as err:
                log.warning("qstore worker: job %s could not be given back (%s); the maintainer rescues "
                            "it once its heartbeat is stale", job.id, describe_failure(err)[0])
                row = None
            self.outages.ok("give-backs", key=a.pair)
            self._handed_back(a, row)
        return failed

    def _handed_back(self, a: Attempt, row: JobRow | None) -> None:
        a.writing = False
        if row is not None:
            self.count("handed_back")
        if a.started_at is None:  # claimed, never started: no handler will let it go
            self.host.forget(a)

    # -- deadlines and heartbeats -------------------------------------------------------------
    @staticmethod
    def ran_past(a: Attempt, now: float, deadline: float) -> bool:
        """The handler ran (time waiting for its callback not counted) longer than
        ``deadline``; never while it waits (the attempt is then ``waiting_external``, which
        the callback's timeout bounds)."""
        assert a.started_at is not None
        waiting, waited = a.ctx.waited(now)
        return not waiting and now - a.started_at - waited > deadline

    def past_deadline(self, now: float) -> list[tuple[Attempt, str]]:
        """The attempts whose handlers ran past their task's deadline, each closed under its
        handler now and held until :meth:`close_past_deadline` has written its closure
        (whenever the handler returns); with the closure's message."""
        with self.lock:
            late = [a for a in self.attempts.values()
                    if a.task is not None and a.task.deadline is not None and a.started_at is not None
                    and not a.deadline_closed and self.ran_past(a, now, a.task.deadline)]
            for a in late:
                a.deadline_closed = True
                a.writing = True  # heartbeated while the closure is pending, though cancelled
                a.holds += 1
        out = []
        for a in late:
            assert a.task is not None and a.task.deadline is not None
            message = f"deadline of {a.task.deadline:g}s exceeded"
            self.host.close_under_handler(a, message)
            out.append((a, message))
        return out

    def close_past_deadline(self, a: Attempt, message: str) -> Procedure:
        """Write the closure of an attempt past its deadline (``fail_retryable``, retried like
        any outcome write), then let it go."""
        try:
            row = yield from self.write(a, Write("fail_retryable (deadline)", "fail_retryable",
                                                 (message, a.ctx.progress), END))
            if row is not None:
                self.count("deadline_exceeded")
        finally:
            self.host.forget(a)

    def heartbeat(self, now: float) -> Procedure:
        """Heartbeat, in one call (two with progress), the attempts not heartbeated for
        ``heartbeat_interval``: running ones, and closed ones whose write is still pending."""
        interval = self.settings.heartbeat_interval
        with self.lock:
            due = [a for a in self.attempts.values()
                   if now - a.last_beat >= interval and (a.writing or not a.ctx.is_cancelled)]
        if not due:
            self.outages.forget("heartbeats")  # nothing to heartbeat: nothing failing either
            return None
        plain = [a for a in due if a.ctx.progress is None or a.ctx.progress == a.sent_progress]
        moving = [a for a in due if a not in plain]
        if plain:
            yield Call("heartbeat_batch", ([a.pair for a in plain],))
        if moving:
            yield Call("heartbeat_progress_batch", ([(a.pair[0], a.pair[1], a.ctx.progress) for a in moving],))
        self.outages.ok("heartbeats")
        for a in due:
            a.last_beat = now
            a.sent_progress = a.ctx.progress
        self.count("heartbeats", len(due))
        return None
