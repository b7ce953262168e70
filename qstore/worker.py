"""The worker: claims jobs of an :class:`~qstore.tasks.App`'s queues and runs their tasks.

``Worker(app, engine, WorkerSettings(...))`` runs, in threads of one process:

* one **dispatcher** per queue: it reserves free capacity (``concurrency`` handlers, plus
  ``prefetch`` claimed jobs waiting for a handler), claims at most that many attempts in one
  call (``claim_runtime_batch``; with ``max_claimers`` the bounded-claimer variant), hands
  them to the handlers and claims again at once while the queue gives work; when a claim
  comes back empty it waits for a ``NOTIFY`` on the queue's channel or ``poll_interval``;
* **handlers**: sync tasks on a pool of ``concurrency`` threads, ``async def`` tasks on one
  event loop thread; what a handler returns or raises is applied to its attempt (see
  :mod:`qstore.tasks`); successful attempts go to the completion batcher
  (:mod:`qstore.batcher`), which completes many of them in one call;
* a **listener** (:mod:`qstore.listen`): one ``LISTEN`` connection for the queues' wake-ups and
  the cancel channel; an operator's cancel of a running attempt sets the handler's
  ``ctx.cancelled`` (and cancels an async handler's task);
* a **keeper** thread: batched heartbeats (``heartbeat_batch``) of attempts running longer than
  ``heartbeat_interval`` (an attempt's claim counts as its first heartbeat, so short jobs are
  never heartbeated), task deadlines, and leadership changes for the log;
* the :class:`~qstore.maintainer.Maintainer` (leader-elected; ``maintain=False`` opts out).

:meth:`Worker.run` blocks and stops on SIGINT / SIGTERM (when called from the main thread);
:meth:`Worker.start` / :meth:`Worker.stop` run it in the background. Stopping: claiming
ends, claimed jobs no handler started are given back at once, running handlers get
``shutdown_timeout`` seconds to finish, then the attempts still running are given back too
(``snooze`` for 0 s: due again at once, the attempt does not count) and their handlers see
``ctx.cancelled``; the batcher is flushed, then the listener, the keeper and the maintainer
stop. A second signal cuts the wait short.
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
from datetime import timedelta
from types import FrameType
from typing import Any

from sqlalchemy import Engine

from qstore.batcher import CompletionBatcher
from qstore.errors import DatabaseError, QueueStorageError, ValidationError
from qstore.listen import Listener
from qstore.maintainer import Maintainer, MaintenanceSchedule
from qstore.model import ClaimedRuntimeJob, JobRow, JobState
from qstore.storage.jobs import validate_queue
from qstore.tasks import (
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
#: Attempts at applying an outcome while the database is unreachable.
OUTCOME_TRIES = (0.1, 0.5, 2.0)


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
    job retryable; ``failed``: jobs that ended failed (an error on the last attempt, whether the queue's
    DLQ policy then moved it to the DLQ or not; ``Fail``; unknown kinds); ``dlq``: jobs a
    handler sent to the DLQ (``Fail(..., dlq=True)``); ``snoozed``, ``retry_after``, ``cancelled``,
    ``waiting_callback``: those outcomes; ``unknown_kind``: jobs no task handles;
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
        self._signals: list[str] = []  # names of the stop signals received (set by the handler)
        self._started = False
        self._threads: list[threading.Thread] = []
        self._dispatchers: list[threading.Thread] = []

        self.batcher = CompletionBatcher(self.storage, engine, max_batch=self.settings.completion_batch,
                                         interval=self.settings.completion_interval)
        self.maintainer: Maintainer | None = (
            Maintainer(self.storage, engine, self.settings.schedule) if self.settings.maintain else None)
        self._pool: _Pool | None = None
        self._loop: _EventLoop | None = None
        self._outcomes: concurrent.futures.ThreadPoolExecutor | None = None
        self._listener: Listener | None = None
        self._leading = False

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

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every thread and return (background mode); :meth:`stop` ends them."""
        if self._started:
            raise RuntimeError("worker already running")
        s = self.settings
        self._started = True
        with self._lock:  # handlers a previous stop left running still hold their places
            self._free = self._capacity_total - len(self._attempts)
        self._stop_requested.clear()
        self._closing.clear()
        self._hurry.clear()
        try:
            if s.listen:
                self._listener = self.storage.listen(self.engine, self.queues, cancel=True)
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
        thread) or :meth:`request_stop`, then stop gracefully; returns the final stats."""
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
            return self.stop(self.settings.shutdown_timeout)
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
        back. Returns the final stats."""
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
        if self._hurry.is_set() and self._attempts:
            log.info("qstore worker: asked again to stop: giving running attempts back now")
        with self._lock:
            left = list(self._attempts.values())
        self._give_back(left, "worker shutting down")
        self.batcher.stop(timeout=max(5.0, min(limit, 30.0)))
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
                log.warning("qstore worker: claim on queue %s failed: %s", queue, err)
                wake.wait(s.error_backoff)  # a stop sets it
                continue
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

    def _unknown(self, a: _Attempt) -> Fail:
        self._count("unknown_kind")
        return Fail(f"unknown task kind {a.claimed.job.kind!r}: no task of this worker's app is "
                    f"registered under it (known: {', '.join(sorted(self.app.tasks)) or 'none'})")

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
        with self._lock:
            if self._attempts.pop(a.pair, None) is None:
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
        except Exception:
            self._count("outcome_errors")
            log.exception("qstore worker: job %s: outcome could not be applied", a.pair[0])
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
            row = self._write(a, lambda: st.fail_retryable(e, job.id, job.run_lease, error, progress))
            if row is not None:
                self._count_end(row, job)
        else:
            self.batcher.submit(a.claimed, a.ctx.followups)

    def _count_end(self, row: JobRow, job: JobRow) -> None:
        if row.state is JobState.RETRYABLE:
            self._count("retried")
        else:  # exhausted: failed history, or the DLQ when the queue's policy says so
            self._count("failed")
            log.warning("qstore worker: job %s (%s) failed for good after attempt %d", job.id, job.kind,
                        job.attempt)

    def _apply_outcome(self, a: _Attempt, o: JobOutcome) -> None:
        job = a.claimed.job
        st, e, p = self.storage, self.engine, a.ctx.progress
        if isinstance(o, Snooze):
            if self._write(a, lambda: st.snooze(e, job.id, job.run_lease, o.seconds, p)) is not None:
                self._count("snoozed")
        elif isinstance(o, RetryAfter):
            if self._write(a, lambda: st.retry_after(e, job.id, job.run_lease, o.seconds, p)) is not None:
                self._count("retry_after")
        elif isinstance(o, Cancel):
            if self._write(a, lambda: st.cancel_running(e, job.id, job.run_lease, o.reason, p)) is not None:
                self._count("cancelled")
        elif isinstance(o, Fail):
            if o.dlq:
                row = self._write(a, lambda: st.fail_to_dlq(e, job.id, job.run_lease, o.dlq_reason, o.error, p))
                name = "dlq"
            else:
                row = self._write(a, lambda: st.fail_terminal(e, job.id, job.run_lease, o.error, p))
                name = "failed"
            if row is not None:
                self._count(name)
        elif isinstance(o, WaitForCallback):
            if self._write(a, lambda: self._wait_for_callback(a, o)):
                self._count("waiting_callback")
        else:  # a JobOutcome subclass of the application's own: treat as an error
            self._apply(a, TypeError(f"unsupported outcome {type(o).__name__}"))

    def _wait_for_callback(self, a: _Attempt, o: WaitForCallback) -> bool | None:
        job = a.claimed.job
        st = self.storage
        with self.engine.begin() as conn:
            token = o.callback_id
            if token is None:
                token = st.register_callback(conn, job.id, job.run_lease, o.timeout)
            entered = st.enter_callback_wait(conn, job.id, job.run_lease, token)
        return True if entered else None

    def _write(self, a: _Attempt, call: Callable[[], Any]) -> Any:
        """Run one outcome call, retrying while the database is unreachable; None (counted
        stale) when the attempt was closed elsewhere first."""
        for delay in (*OUTCOME_TRIES, None):
            try:
                result = call()
                break
            except DatabaseError as err:
                if delay is None or self._hurry.is_set():
                    raise
                log.warning("qstore worker: job %s: writing its outcome failed (%s); retrying",
                            a.pair[0], err)
                time.sleep(delay)
            except ValidationError as err:
                if err.field == "job":  # register_callback of an attempt closed meanwhile
                    result = None
                    break
                raise
        if result is None or result is False:
            self._count("stale_outcomes")
            log.debug("qstore worker: job %s: outcome of a closed attempt ignored", a.pair[0])
            return None
        return result

    # -- give back, cancel, deadline -------------------------------------------------------------
    def _waiting_attempts(self) -> list[_Attempt]:
        with self._lock:
            return [a for a in self._attempts.values() if a.started_at is None]

    def _close_under_handler(self, a: _Attempt, reason: str) -> None:
        a.ctx.cancel(reason)
        if a.atask is not None and self._loop is not None:
            self._loop.cancel(a.atask)

    def _give_back(self, attempts: list[_Attempt], reason: str) -> None:
        """Hand ``attempts`` back to the queue (``snooze`` 0 s: due at once, the attempt does
        not count); their handlers, if running, see ``ctx.cancelled``."""
        for a in attempts:
            waiting = a.started_at is None
            self._close_under_handler(a, reason)
            job = a.claimed.job
            try:
                row = self.storage.snooze(self.engine, job.id, job.run_lease, 0)
            except QueueStorageError as err:
                log.warning("qstore worker: job %s could not be given back (%s); it will be rescued",
                            job.id, err)
                row = None
            if row is not None:
                self._count("handed_back")
            if waiting:
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
        with self._lock:
            late = [a for a in self._attempts.values()
                    if a.task is not None and a.task.deadline is not None and a.started_at is not None
                    and not a.deadline_closed and self._ran_past(a, now, a.task.deadline)]
        for a in late:
            a.deadline_closed = True
            assert a.task is not None and a.task.deadline is not None
            message = f"deadline of {a.task.deadline:g}s exceeded"
            self._close_under_handler(a, message)
            job = a.claimed.job
            try:
                row = self.storage.fail_retryable(self.engine, job.id, job.run_lease, message, a.ctx.progress)
            except QueueStorageError as err:
                log.warning("qstore worker: job %s: closing it past its deadline failed (%s)", job.id, err)
                continue
            if row is not None:
                self._count("deadline_exceeded")
                self._count_end(row, job)

    # -- background loops ------------------------------------------------------------------------
    def _listen_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closing.is_set():
            try:
                wake = listener.wait(max(self.settings.poll_interval, 5.0))
            except Exception as err:
                log.warning("qstore worker: listener failed (%s)", err)
                self._closing.wait(1.0)
                continue
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
            try:
                self._check_deadlines(now)
                self._heartbeat(now)
            except Exception as err:
                log.warning("qstore worker: heartbeat failed (%s); retrying", err)
            self._watch_leadership()

    def _heartbeat(self, now: float) -> None:
        interval = self.settings.heartbeat_interval
        with self._lock:
            due = [a for a in self._attempts.values()
                   if now - a.last_beat >= interval and not a.ctx.is_cancelled]
        if not due:
            return
        plain = [a for a in due if a.ctx.progress is None or a.ctx.progress == a.sent_progress]
        moving = [a for a in due if a not in plain]
        if plain:
            self.storage.heartbeat_batch(self.engine, [a.pair for a in plain])
        if moving:
            self.storage.heartbeat_progress_batch(
                self.engine, [(a.pair[0], a.pair[1], a.ctx.progress) for a in moving])
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
