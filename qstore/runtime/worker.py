"""The worker: claims jobs of an :class:`~qstore.tasks.App`'s queues and runs their tasks.

``Worker(app, engine, WorkerSettings(...))`` runs, in threads of one process:

* one **dispatcher** per queue: it reserves free capacity (``concurrency`` handlers, plus
  ``prefetch`` claimed jobs waiting for a handler), claims at most that many attempts in one
  call (``claim_runtime_batch``; with ``max_claimers`` the bounded-claimer variant), hands
  them to the handlers and claims again at once while the queue gives work; when a claim
  comes back empty it waits for a ``NOTIFY`` on the queue's channel or ``poll_interval``;
* **handlers**: sync tasks on a pool of ``concurrency`` threads, ``async def`` tasks on one
  event loop thread; what a handler returns or raises is applied to its attempt (see
  :mod:`qstore.runtime.tasks`); successful attempts go to the completion batcher
  (:mod:`qstore.runtime.batcher`), which completes many of them in one call;
* a **listener** (:mod:`qstore.storage.listen`): one ``LISTEN`` connection for the queues' wake-ups and
  the cancel channel; an operator's cancel of a running attempt sets the handler's
  ``ctx.cancelled`` (and cancels an async handler's task);
* a **keeper** thread: batched heartbeats (``heartbeat_batch``) of attempts running longer than
  ``heartbeat_interval`` (an attempt's claim counts as its first heartbeat, so short jobs are
  never heartbeated), task deadlines, and leadership changes for the log;
* the :class:`~qstore.runtime.maintainer.Maintainer` (leader-elected; ``maintain=False`` opts out).

:meth:`Worker.run` blocks and stops on SIGINT / SIGTERM (when called from the main thread);
:meth:`Worker.start` / :meth:`Worker.stop` run it in the background. Stopping: claiming
ends, claimed jobs no handler started are given back at once, running handlers get
``shutdown_timeout`` seconds to finish, then the attempts still running are given back too
(``snooze`` for 0 s: due again at once, the attempt does not count) and their handlers see
``ctx.cancelled``; the batcher is flushed, then the listener, the keeper and the maintainer
stop. A second signal cuts the wait short.

While the database is away, nothing is dropped early: claims, completions, heartbeats and
the listener retry, and an outcome write is retried until shortly before its attempt would
count as abandoned, then the attempt is given back (see :meth:`Worker._write`). Failures are
logged as a few lines per outage (:class:`~qstore.outage.OutageLog`). A worker checks that
its schema is installed before it starts, and stops by itself, with one ERROR line, when
the schema disappears while it runs (:attr:`Worker.failure`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import queue as queue_module
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Any

from sqlalchemy import Engine

from qstore import migrate
from qstore.errors import (
    DatabaseError,
    QueueStorageError,
    SchemaNotInstalledError,
    StaleAttemptError,
    ValidationError,
    translate_errors,
)
from qstore.outage import OutageLog, describe_failure
from qstore.runtime.batcher import CompletionBatcher
from qstore.runtime.core import Unhandled, unhandled
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule
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
from qstore.storage.jobs import validate_queue
from qstore.storage.listen import Listener
from qstore.types import ClaimedRuntimeJob, JobRow, JobState

__all__ = ["Worker", "WorkerSettings", "WorkerStats"]

log = logging.getLogger("qstore.worker")

#: Longest error text a failed attempt records (the message and the raising frame).
MAX_ERROR_CHARS = 2000
#: How long a dispatcher waits for more free handlers before claiming for fewer than half
#: of them (seconds).
CLAIM_LINGER = 0.005
#: How soon a dispatcher whose claim came back partly filled claims again without a
#: notification (seconds; at most ``poll_interval``).
PARTIAL_RECHECK = 0.05
#: Retry delays of an outcome write or a give-back that failed (seconds): the first, doubled
#: after each failure up to the cap. They go on until the attempt's lease ends (see
#: :meth:`Worker._lease_end`) or a stop gives up.
RETRY_FIRST, RETRY_CAP = 0.1, 5.0
#: The part of an attempt's lease that a failing outcome write leaves for giving the attempt
#: back instead: a third of the heartbeat staleness, at most this many seconds.
HAND_BACK_RESERVE = 10.0
#: SQLSTATEs of a statement that named an object which does not exist (schema, table,
#: function): the worker then checks whether its schema is still installed.
MISSING_OBJECT = frozenset({"3F000", "42P01", "42883"})


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
    """How a :class:`Worker` runs. Durations are seconds.

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
    ``max_claimers``: claim through the queue's bounded claimer slots (at most this many
    claimers per queue across workers) with ``claimer_lease_ttl`` / ``claimer_idle``.
    ``shutdown_timeout``: how long stopping waits for running handlers before giving their
    attempts back. ``completion_batch`` / ``completion_interval``: the batcher's flush size
    and delay. ``maintain``: run a :class:`Maintainer` (with ``schedule``).
    ``error_backoff``: wait after a failed claim.
    """

    queues: Sequence[str] | None = None
    concurrency: int = 16
    claim_batch: int = 32
    prefetch: int | None = None
    poll_interval: float = 1.0
    listen: bool = True
    heartbeat_interval: float = 30.0
    claim_deadline: float | None = None
    aging_interval: float | None = None
    max_claimers: int | None = None
    claimer_lease_ttl: float = 30.0
    claimer_idle: float = 10.0
    shutdown_timeout: float = 30.0
    completion_batch: int = 500
    completion_interval: float = 0.003
    maintain: bool = True
    schedule: MaintenanceSchedule | None = None
    error_backoff: float = 1.0

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
    found nothing, those that failed; ``completion_calls``: batcher calls; ``followups``:
    follow-up jobs enqueued with completions; ``in_flight``: attempts held now.
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


_COUNTERS = [f.name for f in fields(WorkerStats)
             if f.name not in ("completed", "stale_completions", "completion_calls", "followups", "in_flight")]


@dataclass(eq=False)
class _Attempt:
    """One claimed attempt this worker holds, from claim to outcome."""

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


class _Pool:
    """A fixed set of daemon threads running submitted calls in order (daemon, so a handler
    that never returns cannot keep the process from exiting after a stop)."""

    def __init__(self, size: int, name: str) -> None:
        self._q: queue_module.SimpleQueue[Callable[[], None] | None] = queue_module.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(size)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while (fn := self._q.get()) is not None:
            try:
                fn()
            except BaseException:  # a pool thread outlives whatever one call does
                log.exception("qstore worker: unexpected error in a handler thread")

    def stop(self, timeout: float) -> None:
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _EventLoop:
    """One asyncio loop on a daemon thread, for ``async def`` handlers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()  # strong references while they run
        self._thread = threading.Thread(target=self._run, name="qstore-asyncio", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def spawn(self, coros: list[Any]) -> None:
        """Start each coroutine as a task of the loop (one wake-up of the loop for all)."""

        def create() -> None:
            for c in coros:
                task = self.loop.create_task(c)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        self.loop.call_soon_threadsafe(create)

    def cancel(self, task: asyncio.Task[Any]) -> None:
        self.loop.call_soon_threadsafe(task.cancel)

    def stop(self, timeout: float) -> None:
        """Cancel the handlers still running, give them ``timeout`` seconds to unwind, then
        stop the loop."""

        async def wind_down() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            if others:
                await asyncio.wait(others, timeout=timeout)
            self.loop.stop()

        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(wind_down(), self.loop)
        self._thread.join(timeout + 1.0)
        if not self._thread.is_alive():
            self.loop.close()


def describe_error(err: BaseException) -> str:
    """``Type: message (at file:line in function)`` of the frame that raised, cut to
    ``MAX_ERROR_CHARS``."""
    text = f"{type(err).__name__}: {err}".rstrip(": ")
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text[:MAX_ERROR_CHARS]


class Worker:
    """Runs ``app``'s tasks against ``engine`` (a synchronous ``Engine`` on the app's
    database) as ``settings`` say; see the module docstring."""

    def __init__(self, app: App, engine: Engine, settings: WorkerSettings | None = None) -> None:
        if not isinstance(app, App):
            raise ValidationError("app", app, "expected qstore.tasks.App")
        if not isinstance(engine, Engine):
            raise ValidationError("engine", engine, "the worker needs a synchronous Engine")
        if settings is not None and not isinstance(settings, WorkerSettings):
            raise ValidationError("settings", settings, "expected WorkerSettings or None")
        self.app = app
        self.storage = app.storage
        self.engine = engine
        self.settings = settings or WorkerSettings()
        queues = self.settings.queues if self.settings.queues is not None else app.queues
        if not queues:
            raise ValidationError("queues", list(queues), "no queue to work: register a task or name queues")
        self.queues: tuple[str, ...] = tuple(queues)
        self.instance_id = uuid.uuid4()
        self._claim_deadline = timedelta(seconds=self.settings.claim_deadline or 0)
        self._aging = timedelta(seconds=self.settings.aging_interval or 0)

        self._lock = threading.Lock()
        self._capacity = threading.Condition(self._lock)
        self._capacity_total = self.settings.concurrency + (self.settings.prefetch or 0)
        self._free = self._capacity_total
        self._batch_floor = max(1, self._free // 2)
        self._attempts: dict[tuple[int, int], _Attempt] = {}
        self._counts = dict.fromkeys(_COUNTERS, 0)

        self._wakes = {q: threading.Event() for q in self.queues}
        self._claiming = threading.Event()  # set while dispatchers may claim
        self._closing = threading.Event()  # set once stopping begins (keeper, listener end)
        self._hurry = threading.Event()  # a second stop request: give back at once
        self._stop_requested = threading.Event()
        self._stopping = threading.Lock()
        self._give_up = threading.Event()  # a stop's wait is over: pending writes hand their attempts back
        self._signals: list[str] = []  # names of the stop signals received (set by the handler)
        self._started = False
        self._threads: list[threading.Thread] = []
        self._dispatchers: list[threading.Thread] = []
        self._failure: QueueStorageError | None = None
        self._staleness = (self.settings.schedule or MaintenanceSchedule()).heartbeat_staleness

        self._outages = OutageLog(log, "qstore worker")
        self.batcher = CompletionBatcher(self.storage, engine, max_batch=self.settings.completion_batch,
                                         interval=self.settings.completion_interval, outages=self._outages)
        self.maintainer: Maintainer | None = (
            Maintainer(self.storage, engine, self.settings.schedule, outages=self._outages)
            if self.settings.maintain else None)
        self._pool: _Pool | None = None
        self._loop: _EventLoop | None = None
        self._outcomes: concurrent.futures.ThreadPoolExecutor | None = None
        self._listener: Listener | None = None
        self._leading = False
        self._unhandled_kinds: set[str] = set()  # kinds whose hand-back was logged

    # -- stats -----------------------------------------------------------------------------------
    @property
    def stats(self) -> WorkerStats:
        """A snapshot of what this worker did (see :class:`WorkerStats`)."""
        b = self.batcher.stats
        with self._lock:
            counts = dict(self._counts)
            in_flight = len(self._attempts)
        return WorkerStats(**counts, completed=b.completed, stale_completions=b.stale,
                           completion_calls=b.calls, followups=b.followups, in_flight=in_flight)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    @property
    def running(self) -> bool:
        return self._started

    @property
    def failure(self) -> QueueStorageError | None:
        """The error that stopped this worker by itself (its schema is no longer installed),
        or None. :meth:`run` raises it once the worker has stopped."""
        return self._failure

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every thread and return (background mode); :meth:`stop` ends them.

        Raises :class:`~qstore.errors.SchemaNotInstalledError` before anything starts when
        the app's schema is not installed in the engine's database, and a
        :class:`~qstore.errors.DatabaseError` when the database cannot be reached."""
        if self._started:
            raise RuntimeError("worker already running")
        self._check_installed()
        s = self.settings
        self._started = True
        with self._lock:  # handlers a previous stop left running still hold their places
            self._free = self._capacity_total - len(self._attempts)
        self._stop_requested.clear()
        self._closing.clear()
        self._hurry.clear()
        self._give_up.clear()
        self._failure = None
        try:
            if s.listen:
                self._listener = Listener(self.engine, self.storage.config, self.queues, cancel=True,
                                          outages=self._outages).open()
            self.batcher.start()
            self._pool = _Pool(s.concurrency, "qstore-handler")
            if any(t.is_async for t in self.app.tasks.values()):
                self._loop = _EventLoop()
            self._outcomes = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, s.concurrency), thread_name_prefix="qstore-outcome")
            if self.maintainer is not None:
                self.maintainer.start()
        except BaseException:
            self._shutdown_threads()
            self._started = False
            raise
        self._claiming.set()
        if self._listener is not None:
            self._spawn(self._listen_loop, "qstore-listener")
        self._spawn(self._keeper_loop, "qstore-keeper")
        for q in self.queues:
            self._dispatchers.append(self._spawn(functools.partial(self._dispatch_loop, q), f"qstore-claim-{q}"))
        log.info("qstore worker started: schema %s, queues %s, concurrency %d%s%s",
                 self.storage.schema(), ", ".join(self.queues), s.concurrency,
                 "" if s.listen else ", polling only", ", maintainer on" if self.maintainer else "")

    # -- the install ---------------------------------------------------------------------------
    @translate_errors
    def _installed(self) -> SchemaNotInstalledError | None:
        """None when the schema is installed, else the error saying so (one probe)."""
        schema = self.storage.schema()
        with self.engine.connect() as conn:
            if migrate.read_recorded_config(conn, schema) is not None:
                return None
            return SchemaNotInstalledError(schema, migrate.found_installs(conn))

    def _check_installed(self) -> None:
        missing = self._installed()
        if missing is not None:
            raise missing

    def _schema_gone(self, err: BaseException) -> SchemaNotInstalledError | None:
        """The error to stop with when ``err`` means that the schema is no longer installed:
        a :class:`SchemaNotInstalledError`, or a statement that named a missing object when a
        probe finds no install either. None otherwise (and when the probe fails)."""
        if isinstance(err, SchemaNotInstalledError):
            return err
        if getattr(err, "sqlstate", None) not in MISSING_OBJECT:
            return None
        try:
            return self._installed()
        except QueueStorageError:
            return None

    def _fatal(self, err: SchemaNotInstalledError) -> None:
        """Stop this worker because of ``err`` (from any of its threads): one ERROR line,
        then a stop that gives every attempt back at once, on a thread of its own;
        :meth:`run` raises ``err`` afterwards."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = err
        log.error("qstore worker: stopping: %s", describe_failure(err)[0])
        self._hurry.set()
        self._give_up.set()
        self._stop_requested.set()
        threading.Thread(target=self.stop, args=(0.0,), name="qstore-stop", daemon=True).start()

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def request_stop(self, *, hurry: bool = False) -> None:
        """Ask :meth:`run` to stop (thread- and signal-safe); ``hurry`` gives running
        attempts back without waiting for them."""
        if hurry:
            self._hurry.set()
        self._stop_requested.set()

    def run(self) -> WorkerStats:
        """Start, block until SIGINT / SIGTERM (handlers installed when called from the main
        thread) or :meth:`request_stop`, then stop gracefully; returns the final stats.

        Raises :class:`~qstore.errors.SchemaNotInstalledError` when the schema is not
        installed (nothing started), or once the worker has stopped because its schema
        disappeared while it ran."""
        installed: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                installed[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            while not self._stop_requested.wait(0.5):
                pass
            if self._signals:
                log.info("qstore worker: %s received, shutting down", self._signals[0])
            stats = self.stop(self.settings.shutdown_timeout)
            if self._failure is not None:
                raise self._failure
            return stats
        finally:
            for sig, previous in installed.items():
                signal.signal(sig, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only flags here: the interrupted main thread may hold the worker's lock
        if self._stop_requested.is_set():
            self._hurry.set()
        self._signals.append(signal.Signals(signum).name)
        self._stop_requested.set()

    def stop(self, timeout: float | None = None) -> WorkerStats:
        """Stop gracefully (see the module docstring): running handlers get ``timeout``
        seconds (default ``settings.shutdown_timeout``) before their attempts are given
        back. Returns the final stats.

        Beyond the handlers, a stop waits only for a claim in flight, the completions still
        to send and the maintenance statement in flight. While the database is away it also
        retries give-backs and outcome writes until each attempt's lease ends, completions
        for ``timeout`` (5 to 30 s); ``request_stop(hurry=True)`` or a second signal gives
        them up at once."""
        with self._stopping:  # one stop at a time; a concurrent second call waits for it
            if not self._started:
                return self.stats
            return self._stop(timeout)

    def _stop(self, timeout: float | None) -> WorkerStats:
        limit = self.settings.shutdown_timeout if timeout is None else max(0.0, float(timeout))
        log.info("qstore worker shutdown begun: %d attempts in flight, waiting up to %gs",
                 len(self._attempts), limit)
        self._stop_requested.set()
        self._claiming.clear()
        for wake in self._wakes.values():
            wake.set()
        self._capacity_notify()
        for t in self._dispatchers:
            t.join()
        self._dispatchers.clear()
        self._give_back(self._waiting_attempts(), "worker shutting down")
        deadline = time.monotonic() + limit
        with self._capacity:
            while self._attempts and not self._hurry.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._capacity.wait(min(remaining, 0.1))
        if self._hurry.is_set() and self._attempts and self._failure is None:
            log.info("qstore worker: asked again to stop: giving running attempts back now")
        with self._lock:
            left = list(self._attempts.values())
        # Outcome writes still failing stop retrying: their attempts are in `left` (a writer
        # lets its attempt go only after its last try), and are given back below.
        self._give_up.set()
        self._give_back(left, "worker shutting down")
        self.batcher.stop(timeout=0.0 if self._failure is not None else max(5.0, min(limit, 30.0)))
        self._shutdown_threads()
        self._started = False
        stats = self.stats
        log.info("qstore worker shutdown done: %d claimed, %d completed, %d retried, %d failed, "
                 "%d handed back, %d stale completions", stats.claimed, stats.completed,
                 stats.retried, stats.failed, stats.handed_back, stats.stale_completions)
        return stats

    def _shutdown_threads(self) -> None:
        self._closing.set()
        self._claiming.clear()
        if self._listener is not None:
            self._listener.interrupt()
        for t in self._threads:
            t.join(5.0)
        self._threads.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.maintainer is not None and self.maintainer.running:
            self.maintainer.stop()
            self._leading = False
        if self._outcomes is not None:
            self._outcomes.shutdown(wait=False, cancel_futures=False)
            self._outcomes = None
        if self._loop is not None:
            self._loop.stop(2.0)
            self._loop = None
        if self._pool is not None:
            self._pool.stop(0.5)
            self._pool = None
        if self.batcher._thread is not None:
            self.batcher.stop(timeout=1.0)

    # -- capacity --------------------------------------------------------------------------------
    def _capacity_notify(self) -> None:
        with self._capacity:
            self._capacity.notify_all()

    def _reserve(self, most: int) -> int:
        """Take up to ``most`` free places; 0 when claiming has stopped. Waits until half the
        capacity (or ``most``) is free, or until one place has been free for
        ``CLAIM_LINGER`` seconds: one claim of many jobs instead of many claims of one."""
        enough = min(most, self._batch_floor)
        with self._capacity:
            free_since: float | None = None
            while self._claiming.is_set() and self._free < enough:
                if self._free <= 0:
                    free_since = None
                    self._capacity.wait(0.5)
                    continue
                now = time.monotonic()
                if free_since is None:
                    free_since = now
                elif now - free_since >= CLAIM_LINGER:
                    break
                self._capacity.wait(CLAIM_LINGER - (now - free_since))
            if not self._claiming.is_set():
                return 0
            n = min(most, self._free)
            self._free -= n
            return n

    def _release(self, n: int) -> None:
        if n:
            with self._capacity:
                was = self._free
                self._free += n
                if was <= 0 or self._free >= self._batch_floor > was or not self._attempts:
                    self._capacity.notify_all()

    # -- claiming --------------------------------------------------------------------------------
    def _claim(self, queue: str, n: int) -> list[ClaimedRuntimeJob]:
        s, st, e = self.settings, self.storage, self.engine
        if s.max_claimers is not None:
            return st.claim_runtime_batch_with_aging_for_instance(
                e, queue, n, self._claim_deadline, self._aging, self.instance_id, s.max_claimers,
                s.claimer_lease_ttl, s.claimer_idle)
        if s.aging_interval is not None:
            return st.claim_runtime_batch_with_aging(e, queue, n, self._claim_deadline, self._aging)
        return st.claim_runtime_batch(e, queue, n, self._claim_deadline)

    def _dispatch_loop(self, queue: str) -> None:
        wake = self._wakes[queue]
        s = self.settings
        what = f"claims on queue {queue!r}"
        while self._claiming.is_set():
            want = self._reserve(s.claim_batch)
            if want == 0:
                break
            wake.clear()
            try:
                jobs = self._claim(queue, want)
            except Exception as err:
                self._release(want)
                self._count("claim_calls")
                self._count("claim_errors")
                gone = self._schema_gone(err)
                if gone is not None:
                    self._fatal(gone)
                    break
                self._outages.failed(what, err, s.error_backoff)
                wake.wait(s.error_backoff)  # a stop sets it
                continue
            self._outages.ok(what)
            self._release(want - len(jobs))
            now = time.monotonic()
            with self._lock:
                self._counts["claim_calls"] += 1
                self._counts["claimed"] += len(jobs)
                if not jobs:
                    self._counts["empty_claims"] += 1
                for j in jobs:
                    task = self.app.get(j.job.kind)
                    ctx = JobContext(j, self.storage, self.engine)
                    a = _Attempt(j, ctx, task, now, now)
                    self._attempts[a.pair] = a
            if jobs:
                self._launch([self._attempts[(j.job.id, j.job.run_lease)] for j in jobs])
            if len(jobs) < want:
                # The queue had no more for this claim. Claiming again at once would mostly
                # come back empty (a round trip and a claim's server time for nothing); wait
                # for a notification instead, which a claim in flight does not lose. After a
                # partial claim the rest may sit in lanes another claimer held: look again soon.
                wake.wait(s.poll_interval if not jobs else min(s.poll_interval, PARTIAL_RECHECK))

    def _launch(self, attempts: list[_Attempt]) -> None:
        """Hand claimed attempts to their handlers: sync ones to the thread pool, async
        ones to the event loop (all of one claim in one hop to the loop)."""
        on_loop = []
        for a in attempts:
            if a.task is not None and a.task.is_async:
                on_loop.append(a)
            else:
                assert self._pool is not None
                self._pool.submit(functools.partial(self._run_sync, a))
        if on_loop:
            assert self._loop is not None
            self._loop.spawn([self._run_async(a) for a in on_loop])

    # -- running handlers ------------------------------------------------------------------------
    def _call(self, a: _Attempt) -> Any:
        assert a.task is not None
        args = a.claimed.job.args
        if isinstance(args, dict):
            return a.task.fn(a.ctx, **args)
        return a.task.fn(a.ctx, args)

    def _unknown(self, a: _Attempt) -> Unhandled:
        """The hand-back of an attempt whose kind no task of this worker's app has, logged
        once per kind (WARNING)."""
        job = a.claimed.job
        with self._lock:
            first = job.kind not in self._unhandled_kinds
            self._unhandled_kinds.add(job.kind)
        if first:
            log.warning("qstore worker: no task for kind %r (queue %r): handing its jobs back for a worker "
                        "that has one (snooze with backoff, the attempt not counted); known kinds: %s",
                        job.kind, job.queue, ", ".join(sorted(self.app.tasks)) or "none")
        return unhandled(job, datetime.now(timezone.utc))

    def _run_sync(self, a: _Attempt) -> None:
        if a.ctx.is_cancelled:  # given back or cancelled before a handler took it
            self._forget(a)
            return
        a.started_at = time.monotonic()
        outcome: Any
        if a.task is None:
            outcome = self._unknown(a)
        else:
            try:
                outcome = self._call(a)
                if inspect.isawaitable(outcome):
                    close = getattr(outcome, "close", None)
                    if close is not None:
                        close()
                    outcome = TypeError(f"task {a.task.kind!r} is not declared async but returned an "
                                        "awaitable; declare it with async def")
            except JobOutcome as raised:
                outcome = raised
            except BaseException as err:
                outcome = err
        self._finish(a, outcome)

    async def _run_async(self, a: _Attempt) -> None:
        if a.ctx.is_cancelled:
            self._forget(a)
            return
        a.atask = asyncio.current_task()
        a.started_at = time.monotonic()
        outcome: Any
        try:
            if a.ctx.is_cancelled:  # cancelled between the check and taking the task
                raise asyncio.CancelledError
            outcome = await self._call(a)
        except JobOutcome as raised:
            outcome = raised
        except asyncio.CancelledError as err:
            outcome = err  # dropped below when the attempt was closed under the handler
        except BaseException as err:
            outcome = err
        a.atask = None
        loop = asyncio.get_running_loop()
        if self._outcomes is None or not self._writes(a, outcome):
            self._finish(a, outcome)  # no database call: finish on the loop
            return
        try:
            await loop.run_in_executor(self._outcomes, self._finish, a, outcome)
        except RuntimeError:  # the executor was shut down under us: finish here
            self._finish(a, outcome)

    @staticmethod
    def _writes(a: _Attempt, outcome: Any) -> bool:
        """Whether finishing ``a`` with ``outcome`` calls the database right away (a
        completion only goes to the batcher)."""
        return not a.ctx.is_cancelled and isinstance(outcome, BaseException)

    def _forget(self, a: _Attempt) -> None:
        """Let ``a`` go once neither its handler nor a deadline's closure needs it: until
        then it keeps its place, is heartbeated, and a stop gives it back."""
        with self._lock:
            a.holds -= 1
            if a.holds > 0 or self._attempts.pop(a.pair, None) is None:
                return
        self._release(1)

    def _finish(self, a: _Attempt, outcome: Any) -> None:
        """Apply what the handler produced to its attempt, then let the attempt go."""
        try:
            if a.ctx.is_cancelled:
                self._count("closed_under_handler")
                log.debug("qstore worker: job %s: attempt closed while its handler ran (%s); "
                          "result dropped", a.pair[0], a.ctx.cancel_reason)
            else:
                self._apply(a, outcome)
        except Exception:  # a bug: the attempt must not stay running behind the worker's back
            self._count("outcome_errors")
            log.exception("qstore worker: job %s: outcome could not be applied; giving the attempt back",
                          a.pair[0])
            self._give_back([a], "outcome could not be applied", until_lease=True)
        finally:
            self._forget(a)

    def _apply(self, a: _Attempt, outcome: Any) -> None:
        job = a.claimed.job
        st, e = self.storage, self.engine
        progress = a.ctx.progress
        if isinstance(outcome, JobOutcome):
            self._apply_outcome(a, outcome)
        elif isinstance(outcome, BaseException):
            error = describe_error(outcome)
            log.debug("qstore worker: job %s (%s) attempt %d raised %s", job.id, job.kind, job.attempt,
                      error, exc_info=outcome)
            row = self._write(a, "fail_retryable", lambda: st.fail_retryable(e, job.id, job.run_lease, error, progress))
            if row is not None:
                self._count_end(row, job)
        else:
            self.batcher.submit(a.claimed, a.ctx.followups)

    def _count_end(self, row: JobRow, job: JobRow) -> None:
        if row.state is JobState.RETRYABLE:
            self._count("retried")
        else:  # exhausted: failed history, or the DLQ when the queue's policy says so
            self._count("failed")
            self._count("exhausted")
            log.warning("qstore worker: job %s (%s) failed for good after attempt %d", job.id, job.kind,
                        job.attempt)

    def _apply_outcome(self, a: _Attempt, o: JobOutcome) -> None:
        job = a.claimed.job
        st, e, p = self.storage, self.engine, a.ctx.progress
        if isinstance(o, Snooze):
            if self._write(a, "snooze", lambda: st.snooze(e, job.id, job.run_lease, o.seconds, p)) is not None:
                self._count("snoozed")
        elif isinstance(o, RetryAfter):
            if self._write(a, "retry_after", lambda: st.retry_after(e, job.id, job.run_lease, o.seconds, p)) is not None:
                self._count("retry_after")
        elif isinstance(o, Cancel):
            if self._write(a, "cancel_running", lambda: st.cancel_running(e, job.id, job.run_lease, o.reason, p)) is not None:
                self._count("cancelled")
        elif isinstance(o, Fail):
            if o.dlq:
                row = self._write(a, "fail_to_dlq",
                                  lambda: st.fail_to_dlq(e, job.id, job.run_lease, o.dlq_reason, o.error, p))
                name = "dlq"
            else:
                row = self._write(a, "fail_terminal", lambda: st.fail_terminal(e, job.id, job.run_lease, o.error, p))
                name = "failed"
            if row is not None:
                self._count(name)
        elif isinstance(o, WaitForCallback):
            if self._write(a, "wait_for_callback", lambda: st.wait_for_callback(
                    e, job.id, job.run_lease, o.timeout, callback_id=o.callback_id)) is not None:
                self._count("waiting_callback")
        elif isinstance(o, Unhandled):
            if self._write(a, "snooze (no task for its kind)",
                           lambda: st.snooze(e, job.id, job.run_lease, o.seconds, o.progress)) is not None:
                self._count("unknown_kind")
        else:  # a JobOutcome subclass of the application's own: treat as an error
            self._apply(a, TypeError(f"unsupported outcome {type(o).__name__}"))

    # -- writes that must land -------------------------------------------------------------------
    def _lease_end(self, a: _Attempt) -> float:
        """When ``a`` counts as abandoned (``time.monotonic()``): its last heartbeat (or its
        claim) plus the heartbeat staleness, or its storage deadline if that comes first."""
        end = a.last_beat + self._staleness
        if self.settings.claim_deadline is not None:
            end = min(end, a.claimed_at + self.settings.claim_deadline)
        return end

    def _write(self, a: _Attempt, name: str, call: Callable[[], Any], *, fallback: bool = True) -> Any:
        """Run the outcome call ``name`` of ``a`` until it lands; returns its result, or None
        (counted stale) when the attempt was closed elsewhere first.

        A database error is retried with a growing delay (``RETRY_FIRST`` doubled up to
        ``RETRY_CAP``) until a reserve before the attempt's lease ends (a third of the heartbeat
        staleness, at most ``HAND_BACK_RESERVE`` seconds), or until a stop gives up; the
        attempt is then given back (``snooze`` 0 s, retried until its lease ends). A call
        refused for another reason (a bad value in the outcome) ends the attempt
        ``fail_retryable`` with the refusal instead (``fallback``; a give-back would run the
        same handler again at once, and again), and is given back if that is refused too.
        Returns None in those cases. The attempt is heartbeated meanwhile."""
        job = a.claimed.job
        what = "outcome writes"
        until = self._lease_end(a) - min(self._staleness / 3, HAND_BACK_RESERVE)
        delay = RETRY_FIRST
        a.writing = True
        try:
            while True:
                try:
                    result = call()
                except StaleAttemptError:
                    result = None  # the attempt was closed meanwhile (e.g. before its callback registered)
                except ValidationError as err:
                    return self._refused(a, name, err, fallback=fallback)
                except DatabaseError as err:
                    gone = self._schema_gone(err)
                    if gone is not None:
                        self._outages.forget(what, key=a.pair)
                        self._fatal(gone)
                        return None
                    wait = min(delay, until - time.monotonic())
                    if wait <= 0 or self._give_up.is_set() or self._hurry.is_set():
                        self._outages.failed(what, err, None, key=a.pair,
                                             detail=f"job {job.id}: {name}, giving the attempt back")
                        self._outages.forget(what, key=a.pair)
                        self._count("outcome_errors")
                        self._give_back([a], f"{name} could not be written", until_lease=True)
                        return None
                    self._outages.failed(what, err, wait, key=a.pair, detail=f"job {job.id}: {name}")
                    self._give_up.wait(wait)
                    delay = min(delay * 2, RETRY_CAP)
                    continue
                except Exception as err:  # refused (a QueueStorageError), or a bug (logged with its traceback)
                    return self._refused(a, name, err, fallback=fallback)
                self._outages.ok(what, key=a.pair)
                break
        finally:
            a.writing = False
        if result is None or result is False:
            self._count("stale_outcomes")
            log.debug("qstore worker: job %s: outcome of a closed attempt ignored", job.id)
            return None
        return result

    def _refused(self, a: _Attempt, name: str, err: Exception, *, fallback: bool) -> None:
        """``name`` of ``a`` failed for a reason a retry cannot fix: say so, then end the
        attempt ``fail_retryable`` with the reason (``fallback``) or give it back."""
        self._count("outcome_errors")
        text, sqlstate = describe_failure(err)
        then = "failing the attempt with the reason" if fallback else "giving the attempt back"
        log.warning("qstore worker: job %s: %s refused (%s): %s; %s", a.pair[0], name,
                    f"SQLSTATE {sqlstate}" if sqlstate else "no SQLSTATE", text, then,
                    exc_info=None if isinstance(err, QueueStorageError) else err)
        if not fallback:
            self._give_back([a], f"{name} refused", until_lease=True)
            return
        job = a.claimed.job
        message = f"the outcome {name} was refused: {text}"[:MAX_ERROR_CHARS]
        row = self._write(a, "fail_retryable", lambda: self.storage.fail_retryable(
            self.engine, job.id, job.run_lease, message), fallback=False)
        if row is not None:
            self._count_end(row, job)

    # -- give back, cancel, deadline -------------------------------------------------------------
    def _waiting_attempts(self) -> list[_Attempt]:
        with self._lock:
            return [a for a in self._attempts.values() if a.started_at is None]

    def _close_under_handler(self, a: _Attempt, reason: str) -> None:
        a.ctx.cancel(reason)
        if a.atask is not None and self._loop is not None:
            self._loop.cancel(a.atask)

    def _give_back(self, attempts: list[_Attempt], reason: str, *, until_lease: bool = False) -> None:
        """Hand ``attempts`` back to the queue (``snooze`` 0 s: due at once, the attempt does
        not count); their handlers, if running, see ``ctx.cancelled``.

        A database error is retried (``RETRY_FIRST`` doubled up to ``RETRY_CAP``) until the
        attempt's lease ends or a hurried stop. With ``until_lease`` (an outcome write that
        gave up) the retries also end when a stop gives up: the stop holds the attempt too and
        gives it back itself. An attempt that cannot be given back is logged; the maintainer
        rescues it once its heartbeat is stale."""
        what = "give-backs"
        for a in attempts:
            self._close_under_handler(a, reason)
        ends = self._give_up if until_lease else self._hurry
        pending, delay = list(attempts), RETRY_FIRST
        while pending:
            failed = self._snooze_back(pending)
            if not failed:
                return
            now = time.monotonic()
            over = ends.is_set() or self._hurry.is_set()
            retry = [] if over else [(a, err) for a, err in failed if self._lease_end(a) > now]
            kept = {id(a) for a, _ in retry}
            for a, err in failed:
                if id(a) in kept:
                    continue
                if until_lease and self._give_up.is_set() and not self._hurry.is_set():
                    a.writing = False
                    continue  # the stop gives it back
                self._outages.failed(what, err, None, key=a.pair,
                                     detail=f"job {a.pair[0]} not given back; the maintainer rescues it "
                                            "once its heartbeat is stale")
                self._outages.forget(what, key=a.pair)
                self._handed_back(a, None)
            if not retry:
                return
            wait = max(0.0, min(delay, *(self._lease_end(a) - now for a, _ in retry)))
            for a, err in retry:
                self._outages.failed(what, err, wait, key=a.pair, detail=f"job {a.pair[0]}")
            ends.wait(wait)
            delay = min(delay * 2, RETRY_CAP)
            pending = [a for a, _ in retry]

    def _snooze_back(self, attempts: list[_Attempt]) -> list[tuple[_Attempt, DatabaseError]]:
        """One ``snooze(0)`` of each attempt; returns those that met a database error."""
        failed = []
        for a in attempts:
            job = a.claimed.job
            a.writing = True
            try:
                row = self.storage.snooze(self.engine, job.id, job.run_lease, 0)
            except DatabaseError as err:
                failed.append((a, err))
                continue
            except QueueStorageError as err:
                log.warning("qstore worker: job %s could not be given back (%s); the maintainer rescues "
                            "it once its heartbeat is stale", job.id, describe_failure(err)[0])
                row = None
            self._outages.ok("give-backs", key=a.pair)
            self._handed_back(a, row)
        return failed

    def _handed_back(self, a: _Attempt, row: JobRow | None) -> None:
        a.writing = False
        if row is not None:
            self._count("handed_back")
        if a.started_at is None:  # claimed, never started: no handler will let it go
            self._forget(a)
    def _cancel_attempt(self, pair: tuple[int, int], reason: str) -> None:
        with self._lock:
            a = self._attempts.get(pair)
        if a is not None:
            log.debug("qstore worker: job %s: %s", pair[0], reason)
            self._close_under_handler(a, reason)

    @staticmethod
    def _ran_past(a: _Attempt, now: float, deadline: float) -> bool:
        """The handler ran (time waiting for its callback not counted) longer than
        ``deadline``; never while it waits (the attempt is then ``waiting_external``, which
        the callback's timeout bounds)."""
        assert a.started_at is not None
        waiting, waited = a.ctx.waited(now)
        return not waiting and now - a.started_at - waited > deadline

    def _check_deadlines(self, now: float) -> None:
        """Close the attempts whose handlers ran past their task's deadline: ``ctx.cancelled``
        at once, and ``fail_retryable`` written off the keeper's thread (it is retried like
        any outcome write, and must not hold up the heartbeats)."""
        with self._lock:
            late = [a for a in self._attempts.values()
                    if a.task is not None and a.task.deadline is not None and a.started_at is not None
                    and not a.deadline_closed and self._ran_past(a, now, a.task.deadline)]
        for a in late:
            a.deadline_closed = True
            assert a.task is not None and a.task.deadline is not None
            message = f"deadline of {a.task.deadline:g}s exceeded"
            a.writing = True  # heartbeated while the closure is pending, though cancelled
            with self._lock:
                a.holds += 1  # held until the closure is written, whenever the handler returns
            self._close_under_handler(a, message)
            assert self._outcomes is not None
            self._outcomes.submit(self._close_past_deadline, a, message)

    def _close_past_deadline(self, a: _Attempt, message: str) -> None:
        job = a.claimed.job
        st, e = self.storage, self.engine
        try:
            row = self._write(a, "fail_retryable (deadline)",
                              lambda: st.fail_retryable(e, job.id, job.run_lease, message, a.ctx.progress))
            if row is not None:
                self._count("deadline_exceeded")
                self._count_end(row, job)
        finally:
            self._forget(a)

    # -- background loops ------------------------------------------------------------------------
    def _listen_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closing.is_set():
            try:
                wake = listener.wait(max(self.settings.poll_interval, 5.0))
            except Exception as err:  # the listener handles lost connections itself
                self._outages.failed("LISTEN connection", err, 1.0, key="wait")
                self._closing.wait(1.0)
                continue
            self._outages.ok("LISTEN connection", key="wait")
            woken = list(self._wakes) if wake.missed else wake.queues
            for q in woken:
                event = self._wakes.get(q)
                if event is not None:
                    event.set()
            for pair in wake.cancels:
                self._cancel_attempt(pair, "cancelled by an operator")

    def _keeper_loop(self) -> None:
        s = self.settings
        tick = min(1.0, s.heartbeat_interval / 4)
        while not self._closing.wait(tick):
            now = time.monotonic()
            self._check_deadlines(now)
            try:
                self._heartbeat(now)
            except Exception as err:
                gone = self._schema_gone(err)
                if gone is not None:
                    self._fatal(gone)
                else:
                    self._outages.failed("heartbeats", err, tick)
            self._watch_leadership()

    def _heartbeat(self, now: float) -> None:
        """Heartbeat, in one call (two with progress), the attempts not heartbeated for
        ``heartbeat_interval``: running ones, and closed ones whose write is still pending."""
        interval = self.settings.heartbeat_interval
        with self._lock:
            due = [a for a in self._attempts.values()
                   if now - a.last_beat >= interval and (a.writing or not a.ctx.is_cancelled)]
        if not due:
            self._outages.forget("heartbeats")  # nothing to heartbeat: nothing failing either
            return
        plain = [a for a in due if a.ctx.progress is None or a.ctx.progress == a.sent_progress]
        moving = [a for a in due if a not in plain]
        if plain:
            self.storage.heartbeat_batch(self.engine, [a.pair for a in plain])
        if moving:
            self.storage.heartbeat_progress_batch(
                self.engine, [(a.pair[0], a.pair[1], a.ctx.progress) for a in moving])
        self._outages.ok("heartbeats")
        for a in due:
            a.last_beat = now
            a.sent_progress = a.ctx.progress
        self._count("heartbeats", len(due))

    def _watch_leadership(self) -> None:
        m = self.maintainer
        if m is None:
            return
        try:
            leading = m.is_leader()
        except Exception:
            leading = False
        if leading != self._leading:
            self._leading = leading
            log.info("qstore worker: maintainer leadership %s for schema %s",
                     "taken" if leading else "lost", self.storage.schema())
