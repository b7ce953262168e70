"""The worker: claims jobs of an :class:`~qstore.tasks.App`'s queues and runs their tasks.

``Worker(app, engine, WorkerSettings(...))`` runs, in threads of one process:

* one **dispatcher** per queue: it reserves free capacity (``concurrency`` handlers, plus
  ``prefetch`` claimed jobs waiting for a handler), claims at most that many attempts in one
  call (``claim_runtime_batch``; with ``max_claimers`` the bounded-claimer variant), hands
  them to the handlers and claims again at once while the queue gives work; when a claim
  comes back empty it waits for a ``NOTIFY`` on the queue's channel or ``poll_interval``.
  With ``claims_in_flight`` N > 1 a queue has N dispatchers sharing the capacity: the
  first claims as described, the others only while the queue's claims come back full
  (:class:`~qstore.runtime.core.ClaimCycles`), so up to N claims are in flight at once
  (2 by default). While the handlers are fast a claim may also take places beyond the
  capacity, for the attempts they will have let go by the time it comes back
  (``claim_ahead``, :class:`~qstore.runtime.core.Capacity`);
* **handlers**: sync tasks on a pool of ``concurrency`` threads, ``async def`` tasks on one
  event loop thread; what a handler returns or raises is applied to its attempt (see
  :mod:`qstore.runtime.tasks`); successful attempts go to the completion batcher
  (:mod:`qstore.runtime.batcher`), which completes many of them in one call; the
  dispatcher's next claim takes those waiting along (``complete_and_claim``: one round trip
  completes them and claims the next jobs);
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
count as abandoned, then the attempt is given back (see :meth:`~qstore.runtime.core.WorkerCore.write`). Failures are
logged as a few lines per outage (:class:`~qstore.outage.OutageLog`). A worker checks that
its schema is installed before it starts, and stops by itself, with one ERROR line, when
the schema disappears while it runs (:attr:`Worker.failure`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue as queue_module
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from sqlalchemy import Engine

from qstore import migrate
from qstore.errors import (
    QueueStorageError,
    SchemaNotInstalledError,
    ValidationError,
    translate_errors,
)
from qstore.outage import OutageLog, describe_failure
from qstore.runtime.batcher import CompletionBatcher
from qstore.runtime.core import (
    KEEP_IDLE,
    PARTIAL_RECHECK,
    Attempt,
    Capacity,
    ClaimCycles,
    IdleGiveBack,
    Procedure,
    Sleep,
    WorkerCore,
    WorkerSettings,
    WorkerStats,
    drive,
    schema_error,
    worker_inputs,
)
from qstore.runtime.maintainer import Maintainer
from qstore.runtime.periodic import Planner
from qstore.runtime.pools import ConnectionNeeds, own_pool_engine
from qstore.runtime.tasks import App, JobContext, JobOutcome
from qstore.runtime.telemetry import fast_counts
from qstore.storage.listen import Listener
from qstore.storage.targets import keeping_engine, release_kept
from qstore.types import ClaimedRuntimeJob

__all__ = ["Worker", "WorkerSettings", "WorkerStats"]

log = logging.getLogger("qstore.worker")




class _Pool:
    """A fixed set of daemon threads running submitted calls in order (daemon, so a handler
    that never returns cannot keep the process from exiting after a stop). A call is a
    function and its one argument (no closure to build per call)."""

    def __init__(self, size: int, name: str) -> None:
        self._q: queue_module.SimpleQueue[tuple[Callable[[Any], None], Any] | None] = queue_module.SimpleQueue()
        self.put = self._q.put  # submit((fn, arg)): runs fn(arg) on a pool thread
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(size)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` on a pool thread."""
        self._q.put((fn, arg))

    def _run(self) -> None:
        get = self._q.get
        while (call := get()) is not None:
            try:
                call[0](call[1])
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


def connection_needs(app: App, settings: WorkerSettings, queues: Sequence[str]) -> ConnectionNeeds:
    """The pooled connections a thread worker of ``app`` on ``queues`` uses at once: kept,
    each claim cycle in flight (``claims_in_flight`` per queue, 1 with ``max_claimers``) and
    the maintainer's and planner's lock holders; brief, the batcher, the keeper, a
    maintenance task, the planner's ticks and up to 8 outcome writers."""
    maintain, plan = (1 if settings.maintain else 0), (1 if app.periodic_tasks else 0)
    return ConnectionNeeds(kept=len(queues) * settings.claim_cycles + maintain + plan,
                           brief=2 + maintain + plan + min(8, settings.concurrency))


class Worker:
    """Runs ``app``'s tasks against ``engine`` (a synchronous ``Engine`` on the app's
    database) as ``settings`` say; see the module docstring."""

    def __init__(self, app: App, engine: Engine, settings: WorkerSettings | None = None) -> None:
        self.settings, self.queues = worker_inputs(app, settings)
        if not isinstance(engine, Engine):
            raise ValidationError("engine", engine, "the worker needs a synchronous Engine")
        self.app = app
        self.storage = app.storage
        self.instance_id = uuid.uuid4()

        self._lock = threading.Lock()
        self._capacity = threading.Condition(self._lock)
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

        self._outages = OutageLog(log, "qstore worker")
        self.core = WorkerCore(app, self.settings, self, self._outages,
                               {"give_up": self._give_up, "hurry": self._hurry}, self._lock)
        s = self.settings
        #: the pooled connections this worker's threads use at once
        self.connection_needs = connection_needs(app, s, self.queues)
        if not s.own_pool:
            self.connection_needs.check(engine.pool, "engine")
        #: the engine the worker's connections come from: ``engine`` on a pool of its own
        #: (``own_pool``, see :mod:`qstore.runtime.pools`), else ``engine`` itself
        self.engine = own_pool_engine(engine, self.connection_needs.most) if s.own_pool else engine
        self._attempts = self.core.attempts
        self._places = Capacity(self.settings.concurrency + (self.settings.prefetch or 0), self.core.cycles,
                                self.settings.claim_ahead or 0)
        self._cycles = {q: ClaimCycles(self.core.cycles) for q in self.queues}
        self._busy = {q: threading.Event() for q in self.queues}  # set while the queue is busy (and at a stop)
        self.batcher = CompletionBatcher(self.storage, self.engine, max_batch=self.settings.completion_batch,
                                         interval=self.settings.completion_interval, outages=self._outages)
        if app.telemetry.enabled:
            self.batcher.on_completed = self.core.observe_completed
        self._unwatch: Callable[[], None] | None = None
        self.maintainer: Maintainer | None = (
            Maintainer(self.storage, self.engine, self.settings.schedule, outages=self._outages)
            if self.settings.maintain else None)
        # the app's periodic tasks: their ticks are enqueued by one worker at a time
        self.planner: Planner | None = (
            Planner(self.storage, self.engine, list(app.periodic_tasks.values()), outages=self._outages)
            if app.periodic_tasks else None)
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
        return self.core.stats(b.completed, b.stale, b.calls, b.followups, b.with_claims)

    def _count(self, name: str, n: int = 1) -> None:
        self.core.count(name, n)

    # -- running the core's procedures ---------------------------------------------------------
    def _run(self, proc: Procedure) -> Any:
        """Run one of the core's procedures on this thread (storage calls on the engine)."""
        return drive(proc, self.storage, self.engine, wait=self._sleep, probe=self._schema_gone)

    def _sleep(self, effect: Sleep) -> bool:
        flag = self._give_up if effect.until == "give_up" else self._hurry
        return flag.wait(effect.seconds)

    # -- the core's host -------------------------------------------------------------------------
    def close_under_handler(self, a: Attempt, reason: str) -> None:
        a.ctx.cancel(reason)
        if a.atask is not None and self._loop is not None:
            self._loop.cancel(a.atask)

    def forget(self, a: Attempt) -> None:
        """Let ``a`` go once neither its handler nor a deadline's closure needs it: until
        then it keeps its place, is heartbeated, and a stop gives it back. The attempt and
        its place go in one critical section (the core's lock guards both)."""
        with self._lock:
            if self.core.let_go(a) and self._places.release(1, not self._attempts, True):
                self._capacity.notify_all()

    def complete(self, a: Attempt) -> None:
        self.batcher.submit(a.claimed, a.ctx.followups)

    def fatal(self, err: SchemaNotInstalledError) -> None:
        self._fatal(err)

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
            self._places.reset(len(self._attempts), time.monotonic())
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
            if self.planner is not None:
                self.planner.start()
            if self.app.telemetry.enabled:
                self._unwatch = self.app.telemetry.watch(fast_counts(self.storage, self.engine, self.queues))
        except BaseException:
            self._shutdown_threads()
            self._started = False
            raise
        self._claiming.set()
        if self._listener is not None:
            self._spawn(self._listen_loop, "qstore-listener")
        self._spawn(self._keeper_loop, "qstore-keeper")
        for q in self.queues:
            self._cycles[q].busy = False
            self._busy[q].clear()
            for i in range(self.core.cycles):
                self._dispatchers.append(self._spawn(functools.partial(self._dispatch_loop, q, i),
                                                     f"qstore-claim-{ClaimCycles.name(q, i)}"))
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
        said = schema_error(err)
        if said is None or isinstance(said, SchemaNotInstalledError):
            return said
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
        with self._lock:  # (under the lock: a cycle clears its event only while claiming)
            for busy in self._busy.values():
                busy.set()
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
        if self.planner is not None and self.planner.running:
            self.planner.stop()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
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
        if self.settings.own_pool:
            self.engine.pool.dispose()  # its idle connections; a restart opens new ones

    # -- capacity --------------------------------------------------------------------------------
    def _capacity_notify(self) -> None:
        with self._capacity:
            self._capacity.notify_all()

    def _reserve(self, most: int, long_wait: Callable[[], None] | None = None) -> int:
        """Take up to ``most`` free places; 0 when claiming has stopped (see
        :meth:`Capacity.take` for how long it waits). ``long_wait`` is called once if no
        place has come free for :data:`KEEP_IDLE` seconds."""
        with self._capacity:
            free_since: float | None = None
            idle = IdleGiveBack(long_wait is not None)
            while self._claiming.is_set():
                now = time.monotonic()
                n, wait, free_since = self._places.take(most, free_since, now)
                if n:
                    return n
                wait, give_back = idle.step(now, 0.5 if wait is None else wait)
                if give_back and long_wait is not None:
                    long_wait()
                self._capacity.wait(wait)
            return 0

    def _release(self, n: int) -> None:
        """Give back ``n`` places a claim reserved and did not use (an attempt's place goes
        back in :meth:`forget`, a claim's unfilled ones in :meth:`_settle_claim`)."""
        if n:
            with self._capacity:
                if self._places.release(n, not self._attempts):
                    self._capacity.notify_all()

    def _settle_claim(self, queue: str, index: int, want: int, attempts: list[Attempt], rtt: float) -> None:
        """A claim of cycle ``index`` of ``queue`` that reserved ``want`` places came back
        after ``rtt`` seconds with ``attempts``, in one critical section: the round trip is
        measured (:meth:`Capacity.landed`), the places it did not fill are given back, the
        queue's cycles learn how it went (:meth:`ClaimCycles.signal`) and the attempts are
        held (:meth:`WorkerCore.hold`), each keeping one of the reserved places until a
        handler or a give-back lets it go (:meth:`forget`)."""
        got = len(attempts)
        with self._lock:
            places = self._places
            wake = places.landed(rtt, time.monotonic())
            if got < want and places.release(want - got, not self._attempts):
                wake = True
            self._cycles[queue].signal(index, want, got, claiming=self._claiming.is_set(),
                                       busy=self._busy[queue], wake=self._wakes[queue])
            self.core.hold(attempts)
            if wake:
                self._capacity.notify_all()

    # -- claiming --------------------------------------------------------------------------------
    def _claim(self, queue: str, n: int, engine: Engine) -> list[ClaimedRuntimeJob]:
        """Claim up to ``n`` attempts of ``queue`` on ``engine`` (the cycle's
        :func:`keeping_engine`), taking the completions waiting in the batcher along (one
        ``complete_and_claim`` round trip) when there are any."""
        lent = self.batcher.lend() if self.core.claims_complete else []
        call = self.core.claim_call(queue, n, self.instance_id, [c.claimed for c in lent])
        try:
            result = getattr(self.storage, call.op)(engine, *call.args)
        except BaseException as err:
            return self.core.claim_raised(self.batcher, lent, err)
        return self.core.claim_returned(self.batcher, lent, result)

    def _returned(self, queue: str, index: int, want: int, got: int) -> None:
        """Tell the queue's cycles how a claim of cycle ``index`` went (see
        :meth:`ClaimCycles.returned`): a busy queue lets the other cycles claim, a quiet
        one sends them back to waiting."""
        with self._lock:
            self._cycles[queue].signal(index, want, got, claiming=self._claiming.is_set(),
                                       busy=self._busy[queue], wake=self._wakes[queue])

    def _dispatch_loop(self, queue: str, index: int = 0) -> None:
        """Claim cycle ``index`` of ``queue`` (0: the lead; see :class:`ClaimCycles`)."""
        storage, engine = self.storage, self.engine
        # This cycle's claims run on a connection it keeps while it claims often, and hands
        # back before any longer wait (see KEEP_IDLE).
        claims_on = keeping_engine(engine)

        def context(j: ClaimedRuntimeJob) -> JobContext:
            return JobContext(j, storage, engine)  # (handlers run elsewhere: never claims_on)

        try:
            self._claim_cycle(queue, index, claims_on, context)
        finally:
            release_kept(claims_on)
            self.batcher.expect_claims(ClaimCycles.name(queue, index), False)

    def _claim_cycle(self, queue: str, index: int, claims_on: Engine,
                     context: Callable[[ClaimedRuntimeJob], JobContext]) -> None:
        """The loop of :meth:`_dispatch_loop`: claims of cycle ``index`` of ``queue`` on
        ``claims_on`` (a :func:`keeping_engine`) until claiming stops."""
        give_back = functools.partial(release_kept, claims_on)
        wake, busy = self._wakes[queue], self._busy[queue]
        cycles = self._cycles[queue]
        who = ClaimCycles.name(queue, index)
        lead = index == 0
        s = self.settings
        what = f"claims on queue {queue!r}"
        while self._claiming.is_set():
            if not lead:
                if not busy.is_set():
                    give_back()
                busy.wait()  # set while the queue is busy, and by a stop
                if not self._claiming.is_set():
                    break
            want = self._reserve(s.claim_batch, give_back)
            if want == 0:
                break
            if not lead:
                with self._lock:
                    go = cycles.may_claim(index)
                if not go:  # the queue went quiet while this cycle waited for places
                    self._release(want)
                    continue
            else:
                wake.clear()
            sent = time.monotonic()
            try:
                jobs = self._claim(queue, want, claims_on)
            except Exception as err:
                self.batcher.expect_claims(who, False)
                self._release(want)
                self._returned(queue, index, want, 0)
                self._count("claim_calls")
                self._count("claim_errors")
                gone = self._schema_gone(err)
                if gone is not None:
                    self._fatal(gone)
                    break
                self._outages.failed(what, err, s.error_backoff)
                if lead:
                    give_back()
                    wake.wait(s.error_backoff)  # a stop sets it
                continue  # (the other cycles wait for the lead's next full claim)
            self._outages.ok(what)
            rtt = time.monotonic() - sent
            # a full claim: the queue has more, and this dispatcher claims again as soon as
            # places free up; the completions of those places can wait for that claim
            self.batcher.expect_claims(who, len(jobs) >= want)
            attempts = self.core.attempts_of(jobs, context, time.monotonic())
            self._settle_claim(queue, index, want, attempts, rtt)
            if attempts:
                self._launch(attempts)
            if lead and len(jobs) < want:
                # The queue had no more for this claim. Claiming again at once would mostly
                # come back empty (a round trip and a claim's server time for nothing); wait
                # for a notification instead, which a claim in flight does not lose. After a
                # partial claim the rest may sit in lanes another claimer held: look again soon.
                timeout = s.poll_interval if not jobs else min(s.poll_interval, PARTIAL_RECHECK)
                if timeout <= KEEP_IDLE:
                    wake.wait(timeout)
                elif not wake.wait(KEEP_IDLE):  # quiet for a while: the connection goes back
                    give_back()
                    wake.wait(timeout - KEEP_IDLE)

    def _launch(self, attempts: list[Attempt]) -> None:
        """Hand claimed attempts to their handlers: sync ones to the thread pool, async
        ones to the event loop (all of one claim in one hop to the loop)."""
        on_loop = []
        assert self._pool is not None
        put, run = self._pool.put, self._run_sync
        for a in attempts:
            task = a.task
            if task is not None and task.is_async:
                on_loop.append(a)
            else:
                put((run, a))
        if on_loop:
            assert self._loop is not None
            self._loop.spawn([self._run_async(a) for a in on_loop])

    # -- running handlers ------------------------------------------------------------------------
    def _call(self, a: Attempt) -> Any:
        assert a.task is not None
        args = a.claimed.job.args
        if isinstance(args, dict):
            return a.task.fn(a.ctx, **args)
        return a.task.fn(a.ctx, args)

    def _run_sync(self, a: Attempt) -> None:
        ctx = a.ctx
        if ctx.is_cancelled:  # given back or cancelled before a handler took it
            self._forget(a)
            return
        a.started_at = time.monotonic()
        outcome: Any
        task = a.task
        telemetry = self.app.telemetry
        if task is None:
            outcome = self.core.unknown(a)
        elif not (telemetry.enabled and telemetry.recording):  # the app's telemetry records no handler run
            try:
                args = a.claimed.job.args  # (as _call, inlined)
                outcome = task.fn(ctx, **args) if isinstance(args, dict) else task.fn(ctx, args)
                if hasattr(outcome, "__await__"):
                    outcome = self.core.sync_result(a, outcome)
            except JobOutcome as raised:
                outcome = raised
            except BaseException as err:
                outcome = err
        else:
            with self.core.observed(a) as observe:
                try:
                    outcome = self.core.sync_result(a, self._call(a))
                except JobOutcome as raised:
                    outcome = raised
                except BaseException as err:
                    outcome = err
                observe(outcome)
        self._finish(a, outcome)

    async def _run_async(self, a: Attempt) -> None:
        if a.ctx.is_cancelled:
            self._forget(a)
            return
        a.atask = asyncio.current_task()
        a.started_at = time.monotonic()
        outcome: Any
        with self.core.observed(a) as observe:
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
            observe(outcome)
        a.atask = None
        loop = asyncio.get_running_loop()
        if self._outcomes is None or not self.core.writes(a, outcome):
            self._finish(a, outcome)  # no database call: finish on the loop
            return
        try:
            await loop.run_in_executor(self._outcomes, self._finish, a, outcome)
        except RuntimeError:  # the executor was shut down under us: finish here
            self._finish(a, outcome)

    def _forget(self, a: Attempt) -> None:
        self.forget(a)

    def _finish(self, a: Attempt, outcome: Any) -> None:
        """Apply what the handler produced to its attempt, then let the attempt go."""
        if not self.core.finish_plain(a, outcome):
            self._run(self.core.finish(a, outcome))

    # -- give back, cancel, deadline -------------------------------------------------------------
    def _waiting_attempts(self) -> list[Attempt]:
        return self.core.waiting()

    def _give_back(self, attempts: list[Attempt], reason: str, *, until_lease: bool = False) -> None:
        """Hand ``attempts`` back to the queue (see :meth:`WorkerCore.give_back`)."""
        self._run(self.core.give_back(attempts, reason, until_lease=until_lease))

    def _cancel_attempt(self, pair: tuple[int, int], reason: str) -> None:
        a = self.core.get(pair)
        if a is not None:
            log.debug("qstore worker: job %s: %s", pair[0], reason)
            self.close_under_handler(a, reason)

    def _check_deadlines(self, now: float) -> None:
        """Close the attempts whose handlers ran past their task's deadline: ``ctx.cancelled``
        at once, and ``fail_retryable`` written off the keeper's thread (it is retried like
        any outcome write, and must not hold up the heartbeats)."""
        for a, message in self.core.past_deadline(now):
            assert self._outcomes is not None
            self._outcomes.submit(self._run, self.core.close_past_deadline(a, message))

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
        """Heartbeat the attempts that are due (see :meth:`WorkerCore.heartbeat`)."""
        self._run(self.core.heartbeat(now))

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
