"""The asyncio worker: :class:`AsyncWorker` claims jobs of an app's queues and runs their
tasks on an event loop, over an ``AsyncEngine``.

It is the thread worker (:mod:`qstore.runtime.worker`) with another way of waiting: every
decision — what an outcome writes, retries and backoff of a write that fails, give-backs,
deadlines, heartbeats, free capacity, the hand-back of kinds no task handles, what the
stats count — is :class:`~qstore.runtime.core.WorkerCore`'s, and its procedures run here
with ``await`` on :class:`~qstore.aio.AsyncQueueStorage` instead of on threads. Same
:class:`~qstore.runtime.core.WorkerSettings`, same outcomes, same
:class:`~qstore.runtime.core.WorkerStats`.

On the worker's loop, as tasks:

* one **dispatcher** per queue, claiming (``claim_runtime_batch`` and its variants, or
  ``complete_and_claim`` with the completions waiting in the batcher) into free capacity and waking on ``NOTIFY`` (an :class:`~qstore.aio.AsyncListener`, which also
  delivers an operator's cancels) or after ``poll_interval``; with ``claims_in_flight`` N
  > 1, N dispatchers per queue that take turns as the thread worker's do
  (:class:`~qstore.runtime.core.ClaimCycles`);
* **handlers**: at most ``concurrency`` run at once. An ``async def`` handler runs on the
  loop itself (no thread hand-off); a plain ``def`` handler runs on a bounded pool of
  ``concurrency`` daemon threads, so it never blocks the loop;
* the **completion batcher** (:class:`~qstore.runtime.batcher.AsyncCompletionBatcher`);
* the **keeper**: batched heartbeats, task deadlines, leadership changes for the log.

The :class:`~qstore.runtime.maintainer.Maintainer` (``maintain=True``) runs on a thread of
its own with a synchronous ``Engine`` on the same database, which also backs the
``JobContext`` helpers of handlers (``ctx.register_callback``, ``ctx.heartbeat``,
``ctx.wait_for_callback[_async]``): pass ``sync_engine``, or the worker makes one from the
async engine's URL (psycopg driver, a pool of 4) and disposes of it at stop.

``async with AsyncWorker(app, async_engine, settings) as worker:`` runs it for the block;
``await worker.run()`` runs it until SIGINT / SIGTERM (on the main thread's loop) or
:meth:`AsyncWorker.request_stop`. Stopping is the thread worker's: claiming ends, claimed
jobs not started are given back, running handlers get ``shutdown_timeout`` seconds, then
their attempts are given back (async handlers are cancelled; a sync handler cannot be
interrupted: it sees ``ctx.cancelled`` and its late result is dropped), completions are
flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from qstore import migrate
from qstore.aio import AsyncListener
from qstore.errors import (
    QueueStorageError,
    SchemaNotInstalledError,
    ValidationError,
    translate_errors,
    translated,
)
from qstore.outage import OutageLog, describe_failure
from qstore.runtime.batcher import AsyncCompletionBatcher, wait_event
from qstore.runtime.core import (
    KEEP_IDLE,
    PARTIAL_RECHECK,
    Attempt,
    Call,
    Capacity,
    ClaimCycles,
    IdleGiveBack,
    Procedure,
    Sleep,
    WorkerCore,
    WorkerSettings,
    WorkerStats,
    schema_error,
    worker_inputs,
)
from qstore.runtime.maintainer import Maintainer
from qstore.runtime.periodic import Planner
from qstore.runtime.pools import ConnectionNeeds, own_pool_async_engine
from qstore.runtime.tasks import App, JobContext, JobOutcome
from qstore.runtime.telemetry import fast_counts
from qstore.runtime.worker import _Pool
from qstore.storage.targets import keeping_engine, release_kept_async
from qstore.types import ClaimedRuntimeJob

__all__ = ["AsyncWorker"]

log = logging.getLogger("qstore.worker")


@translate_errors
def _probe(conn: Connection, schema: str) -> SchemaNotInstalledError | None:
    if migrate.read_recorded_config(conn, schema) is not None:
        return None
    return SchemaNotInstalledError(schema, migrate.found_installs(conn))


class _Threads:
    """A bounded pool of daemon threads whose calls the loop awaits."""

    def __init__(self, size: int) -> None:
        self._pool = _Pool(size, "qstore-handler")

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on a pool thread; the future (of the running loop) gets its result or
        its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def call(_: None) -> None:
            try:
                ok, value = True, fn()
            except BaseException as err:  # handed to the loop: the outcome of the handler
                ok, value = False, err
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, ok, value)

        self._pool.submit(call, None)
        return future

    def stop(self, timeout: float) -> None:
        self._pool.stop(timeout)


class AsyncWorker:
    """Runs ``app``'s tasks against ``engine`` (an ``AsyncEngine`` on the app's database)
    on the running event loop, as ``settings`` say; see the module docstring."""

    def __init__(self, app: App, engine: AsyncEngine, settings: WorkerSettings | None = None, *,
                 sync_engine: Engine | None = None) -> None:
        self.settings, self.queues = worker_inputs(app, settings)
        if not isinstance(engine, AsyncEngine):
            raise ValidationError("engine", engine, "the async worker needs an AsyncEngine")
        if sync_engine is not None and not isinstance(sync_engine, Engine):
            raise ValidationError("sync_engine", sync_engine, "expected a synchronous Engine or None")
        self.app = app
        self.storage = app.async_storage
        s = self.settings
        #: the pooled connections of ``engine`` this worker uses at once (claims, the batcher,
        #: the keeper, outcome writes; the maintainer and the planner use ``sync_engine``)
        self.connection_needs = ConnectionNeeds(kept=len(self.queues) * s.claim_cycles,
                                                brief=2 + min(8, s.concurrency))
        if not s.own_pool:
            self.connection_needs.check(engine.sync_engine.pool, "engine")
        locks = (1 if s.maintain else 0) + (1 if app.periodic_tasks else 0)
        if sync_engine is not None and locks:
            ConnectionNeeds(kept=locks, brief=1).check(sync_engine.pool, "sync_engine", remedy="")
        #: the engine the worker's claims and completions go through: ``engine`` on a pool
        #: of its own (``own_pool``, see :mod:`qstore.runtime.pools`), else ``engine`` itself
        self.engine = (own_pool_async_engine(engine, self.connection_needs.most) if s.own_pool
                       else engine)
        self.instance_id = uuid.uuid4()
        self._given_sync_engine = sync_engine
        self.sync_engine: Engine | None = sync_engine

        self._give_up = asyncio.Event()  # a stop's wait is over: pending writes hand their attempts back
        self._hurry = asyncio.Event()  # a second stop request: give back at once
        self._claiming = asyncio.Event()  # set while dispatchers may claim
        self._closing = asyncio.Event()  # set once stopping begins (keeper, listener end)
        self._stop_requested = asyncio.Event()
        self._capacity_changed = asyncio.Event()
        self._stopping = asyncio.Lock()
        self._wakes = {q: asyncio.Event() for q in self.queues}
        self._outages = OutageLog(log, "qstore worker")
        self.core = WorkerCore(app, self.settings, self, self._outages,
                               {"give_up": self._give_up, "hurry": self._hurry})
        self._places = Capacity(self.settings.concurrency + (self.settings.prefetch or 0), self.core.cycles,
                                self.settings.claim_ahead or 0)
        self._cycles = {q: ClaimCycles(self.core.cycles) for q in self.queues}
        self._busy = {q: asyncio.Event() for q in self.queues}  # set while the queue is busy (and at a stop)
        self.batcher = AsyncCompletionBatcher(self.storage, self.engine, max_batch=self.settings.completion_batch,
                                              interval=self.settings.completion_interval, outages=self._outages)
        if app.telemetry.enabled:
            self.batcher.on_completed = self.core.observe_completed
        self._unwatch: Callable[[], None] | None = None
        self.maintainer: Maintainer | None = None
        self.planner: Planner | None = None  # the app's periodic tasks (on a thread, like the maintainer)
        self._running: asyncio.Semaphore | None = None
        self._threads: _Threads | None = None
        self._listener: AsyncListener | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._dispatchers: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._failure: QueueStorageError | None = None
        self._signals: list[str] = []
        self._leading = False

    # -- stats and state --------------------------------------------------------------------------
    @property
    def stats(self) -> WorkerStats:
        """A snapshot of what this worker did (see :class:`WorkerStats`)."""
        b = self.batcher.stats
        return self.core.stats(b.completed, b.stale, b.calls, b.followups, b.with_claims)

    @property
    def running(self) -> bool:
        return self._started

    @property
    def failure(self) -> QueueStorageError | None:
        """The error that stopped this worker by itself (its schema is no longer installed),
        or None. :meth:`run` raises it once the worker has stopped."""
        return self._failure

    # -- running the core's procedures ------------------------------------------------------------
    async def _run(self, proc: Procedure) -> Any:
        """Run one of the core's procedures on the loop: storage calls on the async face."""
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    effect = proc.throw(error) if error is not None else proc.send(value)
                except StopIteration as done:
                    return done.value
                value, error = None, None
                try:
                    if isinstance(effect, Call):
                        value = await getattr(self.storage, effect.op)(self.engine, *effect.args,
                                                                         **dict(effect.kwargs))
                    elif isinstance(effect, Sleep):
                        flag = self._give_up if effect.until == "give_up" else self._hurry
                        value = await wait_event(flag, effect.seconds)
                    else:
                        value = await self._schema_gone(effect.err)
                except Exception as err:
                    error = err
        finally:
            proc.close()  # cancelled mid-way: its cleanup (letting the attempt go) still runs

    # -- the core's host --------------------------------------------------------------------------
    def close_under_handler(self, a: Attempt, reason: str) -> None:
        a.ctx.cancel(reason)
        if a.atask is not None and not a.atask.done():
            a.atask.cancel()

    def forget(self, a: Attempt) -> None:
        if self.core.release(a):
            self._release(1, let_go=True)

    def complete(self, a: Attempt) -> None:
        self.batcher.submit(a.claimed, a.ctx.followups)

    def fatal(self, err: SchemaNotInstalledError) -> None:
        """Stop because the schema is gone: one ERROR line, then a stop that gives every
        attempt back at once; :meth:`run` raises ``err`` afterwards."""
        if self._failure is not None:
            return
        self._failure = err
        log.error("qstore worker: stopping: %s", describe_failure(err)[0])
        self._hurry.set()
        self._give_up.set()
        self._stop_requested.set()
        if self._loop is not None:
            self._loop.create_task(self.stop(0.0))

    # -- the install -----------------------------------------------------------------------------
    async def _installed(self) -> SchemaNotInstalledError | None:
        schema = self.app.storage.schema()
        try:
            async with self.engine.connect() as conn:
                return await conn.run_sync(_probe, schema)
        except QueueStorageError:
            raise
        except Exception as err:
            raise translated(err) from err

    async def _schema_gone(self, err: BaseException) -> SchemaNotInstalledError | None:
        said = schema_error(err)
        if said is None or isinstance(said, SchemaNotInstalledError):
            return said
        try:
            return await self._installed()
        except QueueStorageError:
            return None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the worker's tasks on the running loop and return; :meth:`stop` ends them.

        Raises :class:`~qstore.errors.SchemaNotInstalledError` before anything starts when
        the app's schema is not installed, and a :class:`~qstore.errors.DatabaseError` when
        the database cannot be reached."""
        if self._started:
            raise RuntimeError("worker already running")
        missing = await self._installed()
        if missing is not None:
            raise missing
        s = self.settings
        self._loop = asyncio.get_running_loop()
        self._started = True
        self._places.reset(len(self.core.attempts), time.monotonic())
        for flag in (self._stop_requested, self._closing, self._hurry, self._give_up):
            flag.clear()
        self._failure = None
        self._running = asyncio.Semaphore(s.concurrency)
        try:
            if self.sync_engine is None:
                url = self.engine.url.set(drivername="postgresql+psycopg")
                self.sync_engine = create_engine(url, pool_size=4, max_overflow=4)
            if s.listen:
                self._listener = await AsyncListener(self.engine, self.app.storage.config, self.queues,
                                                     cancel=True, outages=self._outages).open()
            self.batcher.start()
            self._threads = _Threads(s.concurrency)
            if s.maintain:
                assert self.sync_engine is not None
                self.maintainer = Maintainer(self.app.storage, self.sync_engine, s.schedule, outages=self._outages)
                await asyncio.to_thread(self.maintainer.start)
            if self.app.periodic_tasks:
                assert self.sync_engine is not None
                self.planner = Planner(self.app.storage, self.sync_engine, list(self.app.periodic_tasks.values()),
                                       outages=self._outages)
                await asyncio.to_thread(self.planner.start)
            if self.app.telemetry.enabled:
                assert self.sync_engine is not None
                self._unwatch = self.app.telemetry.watch(fast_counts(self.app.storage, self.sync_engine, self.queues))
        except BaseException:
            await self._shutdown_tasks()
            self._started = False
            raise
        self._claiming.set()
        if self._listener is not None:
            self._loops.append(self._loop.create_task(self._listen_loop(), name="qstore-listener"))
        self._loops.append(self._loop.create_task(self._keeper_loop(), name="qstore-keeper"))
        for q in self.queues:
            self._cycles[q].busy = False
            self._busy[q].clear()
            for i in range(self.core.cycles):
                self._dispatchers.append(self._loop.create_task(self._dispatch_loop(q, i),
                                                                name=f"qstore-claim-{ClaimCycles.name(q, i)}"))
        log.info("qstore worker started (asyncio): schema %s, queues %s, concurrency %d%s%s",
                 self.app.storage.schema(), ", ".join(self.queues), s.concurrency,
                 "" if s.listen else ", polling only", ", maintainer on" if self.maintainer else "")

    def request_stop(self, *, hurry: bool = False) -> None:
        """Ask :meth:`run` to stop (call it on the worker's loop, or from a signal handler
        the loop runs); ``hurry`` gives running attempts back without waiting for them."""
        if hurry:
            self._hurry.set()
        self._stop_requested.set()

    async def run(self) -> WorkerStats:
        """Start, wait until SIGINT / SIGTERM (handlers installed on the loop when it runs
        on the main thread) or :meth:`request_stop`, then stop gracefully; returns the final
        stats. Raises :class:`~qstore.errors.SchemaNotInstalledError` when the schema is not
        installed, or once the worker has stopped because its schema disappeared."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
        try:
            await self.start()
            await self._stop_requested.wait()
            if self._signals:
                log.info("qstore worker: %s received, shutting down", self._signals[0])
            stats = await self.stop(self.settings.shutdown_timeout)
            if self._failure is not None:
                raise self._failure
            return stats
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop_requested.is_set():
            self._hurry.set()
        self._signals.append(sig.name)
        self._stop_requested.set()

    async def __aenter__(self) -> AsyncWorker:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def stop(self, timeout: float | None = None) -> WorkerStats:
        """Stop gracefully, as the thread worker does (see the module docstring): running
        handlers get ``timeout`` seconds (default ``settings.shutdown_timeout``) before their
        attempts are given back. Returns the final stats."""
        async with self._stopping:
            if not self._started:
                return self.stats
            return await self._stop(timeout)

    async def _stop(self, timeout: float | None) -> WorkerStats:
        limit = self.settings.shutdown_timeout if timeout is None else max(0.0, float(timeout))
        log.info("qstore worker shutdown begun: %d attempts in flight, waiting up to %gs",
                 len(self.core.attempts), limit)
        self._stop_requested.set()
        self._claiming.clear()
        for wake in (*self._wakes.values(), *self._busy.values()):
            wake.set()
        self._capacity_changed.set()
        await asyncio.gather(*self._dispatchers, return_exceptions=True)
        self._dispatchers.clear()
        await self._run(self.core.give_back(self.core.waiting(), "worker shutting down"))
        deadline = time.monotonic() + limit
        while self.core.attempts and not self._hurry.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._capacity_changed.clear()
            await wait_event(self._capacity_changed, min(remaining, 0.1))
        if self._hurry.is_set() and self.core.attempts and self._failure is None:
            log.info("qstore worker: asked again to stop: giving running attempts back now")
        left = self.core.held()
        self._give_up.set()
        await self._run(self.core.give_back(left, "worker shutting down"))
        await self.batcher.stop(timeout=0.0 if self._failure is not None else max(5.0, min(limit, 30.0)))
        await self._shutdown_tasks()
        self._started = False
        stats = self.stats
        log.info("qstore worker shutdown done: %d claimed, %d completed, %d retried, %d failed, "
                 "%d handed back, %d stale completions", stats.claimed, stats.completed,
                 stats.retried, stats.failed, stats.handed_back, stats.stale_completions)
        return stats

    async def _shutdown_tasks(self) -> None:
        self._closing.set()
        self._claiming.clear()
        if self._listener is not None:
            self._listener.interrupt()
        for t in self._loops:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(t), 5.0)
        self._loops.clear()
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        if self.maintainer is not None and self.maintainer.running:
            await asyncio.to_thread(self.maintainer.stop)
            self._leading = False
        if self.planner is not None and self.planner.running:
            await asyncio.to_thread(self.planner.stop)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        handlers = [t for t in self._handlers if not t.done()]
        for t in handlers:
            t.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=2.0)
        if self._threads is not None:
            threads, self._threads = self._threads, None
            await asyncio.to_thread(threads.stop, 0.5)
        if self.batcher._task is not None:
            await self.batcher.stop(timeout=1.0)
        if self._given_sync_engine is None and self.sync_engine is not None:
            self.sync_engine.dispose()
            self.sync_engine = None
        if self.settings.own_pool:
            # its own pool's idle connections (a restart opens new ones); the pool alone, as
            # the engine's dispose would tell the application's engine_disposed listeners
            # that the application's engine was disposed
            await greenlet_spawn(self.engine.sync_engine.pool.dispose)

    # -- capacity --------------------------------------------------------------------------------
    async def _reserve(self, most: int, long_wait: Callable[[], Awaitable[None]] | None = None) -> int:
        """Take up to ``most`` free places; 0 when claiming has stopped. ``long_wait`` is
        awaited once if no place has come free for :data:`KEEP_IDLE` seconds."""
        free_since: float | None = None
        idle = IdleGiveBack(long_wait is not None)
        while self._claiming.is_set():
            now = time.monotonic()
            n, wait, free_since = self._places.take(most, free_since, now)
            if n:
                return n
            wait, give_back = idle.step(now, 0.5 if wait is None else wait)
            if give_back and long_wait is not None:
                await long_wait()
            self._capacity_changed.clear()
            await wait_event(self._capacity_changed, wait)
        return 0

    def _release(self, n: int, let_go: bool = False) -> None:
        """Give ``n`` places back (``let_go``: of an attempt the worker let go)."""
        if n and self._places.release(n, not self.core.attempts, let_go):
            self._capacity_changed.set()

    def _landed(self, rtt: float) -> None:
        """A claim came back after ``rtt`` seconds (see :meth:`Capacity.landed`)."""
        if self._places.landed(rtt, time.monotonic()):
            self._capacity_changed.set()

    # -- claiming --------------------------------------------------------------------------------
    def _context(self, claimed: ClaimedRuntimeJob) -> JobContext:
        return JobContext(claimed, self.app.storage, self.sync_engine)

    def _returned(self, queue: str, index: int, want: int, got: int) -> None:
        """Tell the queue's cycles how a claim of cycle ``index`` went (see
        :meth:`ClaimCycles.returned`)."""
        self._cycles[queue].signal(index, want, got, claiming=self._claiming.is_set(),
                                   busy=self._busy[queue], wake=self._wakes[queue])

    async def _dispatch_loop(self, queue: str, index: int = 0) -> None:
        """Claim cycle ``index`` of ``queue`` (0: the lead; see :class:`ClaimCycles`). Its
        claims run on a connection it keeps while it claims often and hands back before any
        longer wait (see :data:`KEEP_IDLE`), as a thread worker's cycle does."""
        keeping = keeping_engine(self.engine.sync_engine)
        try:
            await self._claim_cycle(queue, index, AsyncEngine(keeping), functools.partial(release_kept_async, keeping))
        finally:
            await release_kept_async(keeping)
            self.batcher.expect_claims(ClaimCycles.name(queue, index), False)

    async def _claim_cycle(self, queue: str, index: int, claims_on: AsyncEngine,
                           give_back: Callable[[], Awaitable[None]]) -> None:
        """The loop of :meth:`_dispatch_loop`: claims of cycle ``index`` of ``queue`` on
        ``claims_on`` (an ``AsyncEngine`` of a :func:`keeping_engine`) until claiming stops;
        ``give_back`` hands the kept connection back."""
        wake, busy = self._wakes[queue], self._busy[queue]
        cycles = self._cycles[queue]
        who = ClaimCycles.name(queue, index)
        lead = index == 0
        s = self.settings
        what = f"claims on queue {queue!r}"
        while self._claiming.is_set():
            if not lead:
                if not busy.is_set():
                    await give_back()
                await busy.wait()  # set while the queue is busy, and by a stop
                if not self._claiming.is_set():
                    break
            want = await self._reserve(s.claim_batch, give_back)
            if want == 0:
                break
            if not lead and not cycles.may_claim(index):  # the queue went quiet meanwhile
                self._release(want)
                continue
            if lead:
                wake.clear()
            sent = time.monotonic()
            try:
                jobs = await self._claim(queue, want, claims_on)
            except Exception as err:
                self.batcher.expect_claims(who, False)
                self._release(want)
                self._returned(queue, index, want, 0)
                self.core.count("claim_calls")
                self.core.count("claim_errors")
                gone = await self._schema_gone(err)
                if gone is not None:
                    self.fatal(gone)
                    break
                self._outages.failed(what, err, s.error_backoff)
                if lead:
                    await give_back()
                    await wait_event(wake, s.error_backoff)  # a stop sets it
                continue  # (the other cycles wait for the lead's next full claim)
            self._outages.ok(what)
            self._landed(time.monotonic() - sent)
            self.batcher.expect_claims(who, len(jobs) >= want)  # a full claim: more to claim soon
            self._release(want - len(jobs))
            self._returned(queue, index, want, len(jobs))
            for a in self.core.claimed(jobs, self._context, time.monotonic()):
                task = asyncio.get_running_loop().create_task(self._handle(a))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)
            if lead and len(jobs) < want:
                timeout = s.poll_interval if not jobs else min(s.poll_interval, PARTIAL_RECHECK)
                if timeout <= KEEP_IDLE:
                    await wait_event(wake, timeout)
                elif not await wait_event(wake, KEEP_IDLE):  # quiet for a while: the connection goes back
                    await give_back()
                    await wait_event(wake, timeout - KEEP_IDLE)

    async def _claim(self, queue: str, n: int, on: AsyncEngine) -> list[ClaimedRuntimeJob]:
        """Claim up to ``n`` attempts of ``queue`` on ``on``, taking the completions waiting
        in the batcher along (one ``complete_and_claim`` round trip) when there are any."""
        lent = self.batcher.lend() if self.core.claims_complete else []
        call = self.core.claim_call(queue, n, self.instance_id, [c.claimed for c in lent])
        try:
            result = await getattr(self.storage, call.op)(on, *call.args)
        except BaseException as err:
            return self.core.claim_raised(self.batcher, lent, err)
        return self.core.claim_returned(self.batcher, lent, result)

    # -- running handlers ------------------------------------------------------------------------
    @staticmethod
    def _call(a: Attempt) -> Any:
        assert a.task is not None
        args = a.claimed.job.args
        if isinstance(args, dict):
            return a.task.fn(a.ctx, **args)
        return a.task.fn(a.ctx, args)

    async def _handle(self, a: Attempt) -> None:
        """Run ``a``'s handler once a place among the ``concurrency`` running ones is free,
        then apply its outcome (on the loop)."""
        assert self._running is not None
        a.atask = asyncio.current_task()  # a give-back or cancel while it waits ends the wait
        outcome: Any = None
        try:
            async with self._running:
                if a.ctx.is_cancelled:  # given back or cancelled before a handler took it
                    a.atask = None
                    self.forget(a)
                    return
                a.started_at = time.monotonic()
                outcome = await self._outcome(a)
        except asyncio.CancelledError as err:
            if a.started_at is None:  # given back or cancelled while waiting for a place
                a.atask = None
                self.forget(a)  # (a give-back let it go already: a second release does nothing)
                return
            outcome = err  # dropped when the attempt was closed under the handler
        a.atask = None
        if not self.core.finish_plain(a, outcome):
            await self._run(self.core.finish(a, outcome))

    async def _outcome(self, a: Attempt) -> Any:
        """What ``a``'s handler returned or raised: an async one awaited on the loop, a sync
        one run on a pool thread (it cannot be interrupted: a cancel only sets its flag)."""
        if a.task is None:
            return self.core.unknown(a)
        with self.core.observed(a) as observe:
            outcome = await self._handler_outcome(a)
            observe(outcome)
            return outcome

    async def _handler_outcome(self, a: Attempt) -> Any:
        assert a.task is not None
        try:
            if a.task.is_async:
                if a.ctx.is_cancelled:
                    raise asyncio.CancelledError
                return await self._call(a)
            a.atask = None  # a sync handler keeps its place until it returns
            assert self._threads is not None
            return self.core.sync_result(a, await self._threads.run(functools.partial(self._call, a)))
        except JobOutcome as raised:
            return raised
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            return err

    # -- cancel and deadlines ----------------------------------------------------------------------
    def _cancel_attempt(self, pair: tuple[int, int], reason: str) -> None:
        a = self.core.get(pair)
        if a is not None:
            log.debug("qstore worker: job %s: %s", pair[0], reason)
            self.close_under_handler(a, reason)

    def _check_deadlines(self, now: float) -> None:
        """Close the attempts whose handlers ran past their task's deadline: ``ctx.cancelled``
        (and an async handler's cancel) at once, ``fail_retryable`` written by a task of its
        own so the heartbeats go on meanwhile."""
        assert self._loop is not None
        for a, message in self.core.past_deadline(now):
            task = self._loop.create_task(self._run(self.core.close_past_deadline(a, message)))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    # -- background loops ------------------------------------------------------------------------
    async def _listen_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closing.is_set():
            try:
                wake = await listener.wait(max(self.settings.poll_interval, 5.0))
            except Exception as err:  # the listener handles lost connections itself
                self._outages.failed("LISTEN connection", err, 1.0, key="wait")
                await wait_event(self._closing, 1.0)
                continue
            self._outages.ok("LISTEN connection", key="wait")
            woken = list(self._wakes) if wake.missed else wake.queues
            for q in woken:
                event = self._wakes.get(q)
                if event is not None:
                    event.set()
            for pair in wake.cancels:
                self._cancel_attempt(pair, "cancelled by an operator")

    async def _keeper_loop(self) -> None:
        s = self.settings
        tick = min(1.0, s.heartbeat_interval / 4)
        while not await wait_event(self._closing, tick):
            now = time.monotonic()
            self._check_deadlines(now)
            try:
                await self._run(self.core.heartbeat(now))
            except Exception as err:
                gone = await self._schema_gone(err)
                if gone is not None:
                    self.fatal(gone)
                else:
                    self._outages.failed("heartbeats", err, tick)
            await self._watch_leadership()

    async def _watch_leadership(self) -> None:
        m = self.maintainer
        if m is None:
            return
        try:
            leading = await asyncio.to_thread(m.is_leader)
        except Exception:
            leading = False
        if leading != self._leading:
            self._leading = leading
            log.info("qstore worker: maintainer leadership %s for schema %s",
                     "taken" if leading else "lost", self.app.storage.schema())

