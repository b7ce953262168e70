"""The completion batcher: successful attempts of many handlers completed in few calls.

A worker hands each attempt whose handler returned to :meth:`CompletionBatcher.submit`
(non-blocking, thread-safe). A background thread sends what has gathered as ONE
``complete_runtime_batch`` call, as soon as ``max_batch`` attempts wait or ``interval``
seconds after the first of them arrived, whichever comes first. On an ``Engine`` that call
is one autocommitted round trip while every attempt can take the fast path.

Guarantees:

* an attempt is completed at most once (the storage guards every completion by
  ``(job_id, run_lease)``); an attempt missing from the call's result was closed by someone
  else first (rescued, cancelled by an operator, given back at shutdown): it is a *stale*
  completion, logged at DEBUG and counted (:attr:`BatcherStats.stale`), never raised;
* a :class:`~qstore.errors.PartialCommitError` keeps what it committed and sends only the
  rest again; any other database error sends the whole batch again after a growing delay,
  until it goes through or the batcher is stopped and its ``flush`` timeout passes (the
  attempts left then are logged and counted as ``abandoned``; the maintainer's heartbeat
  rescue runs their jobs again);
* a worker's dispatcher may take the waiting completions without follow-ups out of the
  batch (:meth:`BatchCore.lend`) to send them with its next claim in one
  ``complete_and_claim`` call, then report what it completed (:meth:`BatchCore.settle_lent`)
  or hand back what it could not send (:meth:`BatchCore.return_lent`): those go out again
  with the batcher's own retries, so a lent completion is counted once and never dropped.
  While a dispatcher expects to claim again soon (:meth:`BatchCore.expect_claims`), the
  batcher holds completions without follow-ups up to ``CLAIM_HOLD`` seconds (never less
  than ``interval``) for that claim;
* an attempt with follow-up jobs (``JobContext.defer``) completes in one transaction with
  those jobs: both commit or neither does. Such attempts of one flush share the
  transaction; when it fails for a reason a retry cannot fix (a unique conflict of a
  follow-up, a bad argument), each attempt is tried alone, and one that still fails ends
  ``fail_retryable`` with the reason, its follow-ups not written.

Failures to reach the database are logged through an :class:`~qstore.outage.OutageLog`
(one WARNING when completions start failing, DEBUG while they go on failing the same way,
one INFO line once they land again); a worker passes its own.

What a flush sends, retries and counts is written once, in :class:`BatchCore`, as a
procedure yielding storage calls (:class:`~qstore.runtime.core.Call`) and retry waits
(:class:`RetryWait`): :class:`CompletionBatcher` runs it on its thread with a synchronous
``Engine``, :class:`AsyncCompletionBatcher` as a task of an event loop with an
``AsyncEngine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from qstore.errors import (
    DatabaseError,
    PartialCommitError,
    QueueStorageError,
    ValidationError,
)
from qstore.outage import OutageLog
from qstore.runtime.core import Call
from qstore.storage import QueueStorage
from qstore.types import ClaimedRuntimeJob, InsertParams, JobRow

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from qstore.aio import AsyncQueueStorage

__all__ = ["AsyncCompletionBatcher", "BatchCore", "BatcherStats", "Completion", "CompletionBatcher",
           "RetryWait", "wait_event"]

log = logging.getLogger("qstore.worker")

RETRY_FIRST, RETRY_CAP = 0.05, 5.0
#: How long completions without follow-ups may wait for a dispatcher's claim to take them
#: along, while one expects to claim soon (seconds; the ``interval`` when that is longer).
CLAIM_HOLD = 0.02


class Completion:
    """One attempt to complete (``pair``: its ``(job_id, run_lease)``), with the follow-up
    jobs to enqueue in its transaction."""

    __slots__ = ("claimed", "followups", "pair")

    def __init__(self, claimed: ClaimedRuntimeJob, followups: Sequence[InsertParams] = ()) -> None:
        self.claimed = claimed
        self.followups = followups
        self.pair = (claimed.job.id, claimed.job.run_lease)

    def __repr__(self) -> str:
        return f"Completion({self.pair}, {len(self.followups)} follow-ups)"


@dataclass
class BatcherStats:
    """Counters of one batcher (a snapshot when read through :attr:`CompletionBatcher.stats`).

    ``calls``: storage calls made (completion calls and joined transactions, and claims that
    took completions along); ``with_claims``: of those, the claims; ``completed``:
    attempts completed; ``stale``: completions of attempts already closed; ``followups``:
    follow-up jobs enqueued; ``followup_failures``: attempts failed because their follow-ups
    could not be written; ``retries``: sends repeated after an error; ``abandoned``:
    attempts given up at stop."""

    calls: int = 0
    with_claims: int = 0
    completed: int = 0
    stale: int = 0
    followups: int = 0
    followup_failures: int = 0
    retries: int = 0
    abandoned: int = 0
    largest_batch: int = 0


def _positive(value: object, name: str, *, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or not value > 0:
        raise ValidationError(name, value, "must be a positive " + ("integer" if integer else "number"))


@dataclass
class _Queue:
    items: list[Completion] = field(default_factory=list)
    first_at: float = 0.0


@dataclass(frozen=True)
class RetryWait:
    """Wait ``delay`` seconds before sending again; the driver sends back False when the
    batcher must give up instead (it is stopping and its flush timeout has passed)."""

    delay: float


#: A flush's procedure: yields storage calls and retry waits.
Procedure = Generator["Call | RetryWait", Any, None]


class BatchCore:
    """What a flush of completions sends, retries and counts (see the module docstring);
    the batchers drive :meth:`send`."""

    def __init__(self, max_batch: int, interval: float, outages: OutageLog | None) -> None:
        _positive(max_batch, "max_batch", integer=True)
        _positive(interval, "interval")
        #: called with the jobs whose completion committed, once per landed call (telemetry)
        self.on_completed: Callable[[list[JobRow]], None] | None = None
        self.max_batch = max_batch
        self.interval = float(interval)
        self._q = _Queue()
        self._stopping = False
        self._give_up_at: float | None = None
        self._busy = False
        self._lent = 0  # completions a dispatcher took along with a claim in flight
        self._claimers: set[str] = set()  # dispatchers that expect to claim again soon
        self._stats = BatcherStats()
        self._stats_lock = threading.Lock()
        self._outages = outages if outages is not None else OutageLog(log, "qstore worker")

    @property
    def stats(self) -> BatcherStats:
        with self._stats_lock:
            return BatcherStats(**vars(self._stats))

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def _retry_delay(self, delay: float) -> float:
        """The wait a :class:`RetryWait` of ``delay`` will make (for the log)."""
        if self._give_up_at is None:
            return delay
        return max(0.0, min(delay, self._give_up_at - time.monotonic()))

    def _take(self) -> list[Completion]:
        """The next batch out of the queue (the rest, if any, due at once)."""
        batch = self._q.items[:self.max_batch]
        del self._q.items[:self.max_batch]
        if self._q.items:
            self._q.first_at = time.monotonic() - self.interval  # the rest is due too
        return batch

    def _due(self) -> float:
        """When the queued completions are due (``time.monotonic()``): ``interval`` after the
        first, or up to ``CLAIM_HOLD`` when a dispatcher is about to take them along."""
        if self._claimers and not self._stopping and not any(c.followups for c in self._q.items):
            return self._q.first_at + max(self.interval, CLAIM_HOLD)
        return self._q.first_at + self.interval

    def _lend(self) -> list[Completion]:
        """Take up to ``max_batch`` queued completions without follow-ups out of the queue."""
        items = self._q.items
        if not items:
            return []
        lent: list[Completion]
        if len(items) <= self.max_batch and not any(c.followups for c in items):
            lent, self._q.items = items, []  # (the usual case: all of them)
        else:
            lent = []
            kept: list[Completion] = []
            for c in items:
                (kept if c.followups or len(lent) >= self.max_batch else lent).append(c)
            self._q.items = kept
        self._lent += len(lent)
        with self._stats_lock:
            self._stats.largest_batch = max(self._stats.largest_batch, len(lent))
        return lent

    def _settle_lent(self, lent: Sequence[Completion], done: Sequence[tuple[int, int]]) -> None:
        self._lent -= len(lent)
        self._count(calls=1, with_claims=1)
        self._outages.ok("completions")
        self._settle(lent, set(done))

    def _return_lent(self, lent: Sequence[Completion]) -> None:
        """Put ``lent`` back at the head of the queue, due at once."""
        self._lent -= len(lent)
        if lent:
            self._q.items[:0] = lent
            self._q.first_at = time.monotonic() - self.interval - CLAIM_HOLD

    def _add(self, claimed: ClaimedRuntimeJob, followups: Sequence[InsertParams]) -> bool:
        """Queue one completion; True when the sender should be woken."""
        if not self._q.items:
            self._q.first_at = time.monotonic()
        self._q.items.append(Completion(claimed, tuple(followups) if followups else ()))
        return len(self._q.items) == 1 or len(self._q.items) >= self.max_batch

    def _left(self) -> None:
        """Count and log what is still queued when the batcher stops."""
        left, self._q.items = self._q.items, []
        if left:
            self._count(abandoned=len(left))
            log.warning("qstore worker: %d completions could not be sent before stopping; their "
                        "attempts will be rescued and run again", len(left))

    # -- the procedure ---------------------------------------------------------------------------
    def send(self, batch: list[Completion]) -> Procedure:
        """Send ``batch``: the attempts without follow-ups in one completion call, those
        with follow-ups joined to theirs; retried as the module docstring says."""
        with self._stats_lock:
            self._stats.largest_batch = max(self._stats.largest_batch, len(batch))
        plain = [c for c in batch if not c.followups]
        joined = [c for c in batch if c.followups]
        if plain:
            yield from self._complete(plain)
        if joined:
            yield from self._complete_joined(joined)

    def _settle(self, items: Sequence[Completion], done: set[tuple[int, int]]) -> None:
        stale = [c.pair for c in items if c.pair not in done]
        if stale:
            log.debug("qstore worker: %d stale completions (attempts closed elsewhere first): %s",
                      len(stale), stale[:20])
        self._count(completed=len(items) - len(stale), stale=len(stale))
        if self.on_completed is not None:
            self._landed([c for c in items if c.pair in done] if stale else items)

    def _landed(self, items: Sequence[Completion]) -> None:
        if self.on_completed is not None and items:
            try:
                self.on_completed([c.claimed.job for c in items])
            except Exception:  # telemetry must never fail a completion that committed
                log.debug("qstore worker: completion observer failed", exc_info=True)

    def _complete(self, items: list[Completion]) -> Procedure:
        delay = RETRY_FIRST
        while items:
            self._count(calls=1)
            try:
                done = yield Call("complete_runtime_batch", ([c.claimed for c in items],))
            except PartialCommitError as err:
                committed = set(err.committed)
                kept = [c for c in items if c.pair in committed]
                self._count(completed=len(kept), retries=1)
                self._landed(kept)
                items = [c for c in items if c.pair not in committed]
                self._outages.failed("completions", err, 0.0,
                                     detail=f"{len(kept)} of {len(kept) + len(items)} committed")
                continue
            except DatabaseError as err:
                self._count(retries=1)
                self._outages.failed("completions", err, self._retry_delay(delay),
                                     detail=f"{len(items)} attempts")
                if not (yield RetryWait(delay)):
                    self._abandon(items)
                    return
                delay = min(delay * 2, RETRY_CAP)
                continue
            except QueueStorageError as err:  # not a database error: sending again cannot help
                self._refused(items, err)
                return
            self._outages.ok("completions")
            self._settle(items, set(done))
            return

    def _refused(self, items: Sequence[Completion], err: QueueStorageError) -> None:
        self._outages.forget("completions")
        self._count(abandoned=len(items))
        log.warning("qstore worker: completion of %d attempts refused (%s); their attempts will be "
                    "rescued and run again", len(items), " ".join(str(err).split()))

    def _abandon(self, items: Sequence[Completion]) -> None:
        self._outages.forget("completions")
        self._count(abandoned=len(items))
        log.warning("qstore worker: gave up %d completions at stop; their attempts will be rescued "
                    "and run again", len(items))

    def _joined_once(self, items: Sequence[Completion]) -> Procedure:
        """Complete ``items`` and enqueue the follow-ups of those completed, in one transaction."""
        self._count(calls=1)
        done = set((yield Call("complete_runtime_batch_with_followups",
                               ([(c.claimed, c.followups) for c in items],))))
        self._count(followups=sum(len(c.followups) for c in items if c.pair in done))
        self._settle(items, done)

    def _complete_joined(self, items: list[Completion]) -> Procedure:
        delay = RETRY_FIRST
        while True:
            try:
                yield from self._joined_once(items)
                self._outages.ok("completions")
                return
            except DatabaseError as err:
                self._count(retries=1)
                self._outages.failed("completions", err, self._retry_delay(delay),
                                     detail=f"{len(items)} attempts with follow-up jobs")
                if not (yield RetryWait(delay)):
                    self._abandon(items)
                    return
                delay = min(delay * 2, RETRY_CAP)
            except QueueStorageError as err:
                if len(items) > 1:  # find the attempt(s) whose follow-ups cannot be written
                    for c in items:
                        yield from self._complete_joined([c])
                    return
                yield from self._follow_up_failed(items[0], err)
                return

    def _follow_up_failed(self, c: Completion, err: QueueStorageError) -> Procedure:
        self._count(followup_failures=1)
        message = f"follow-up jobs could not be enqueued: {err}"
        log.warning("qstore worker: job %s: %s", c.pair[0], message)
        try:
            yield Call("fail_retryable", (c.pair[0], c.pair[1], message))
        except QueueStorageError as again:
            log.warning("qstore worker: job %s could not be failed either (%s); it will be rescued",
                        c.pair[0], again)


class CompletionBatcher(BatchCore):
    """Completes submitted attempts of ``storage`` on ``engine`` in batches (see the module
    docstring). :meth:`start` runs the thread; :meth:`stop` flushes and ends it."""

    def __init__(self, storage: QueueStorage, engine: Engine, *, max_batch: int = 500,
                 interval: float = 0.003, outages: OutageLog | None = None) -> None:
        if not isinstance(engine, Engine):
            raise ValidationError("engine", engine, "the batcher needs a synchronous Engine")
        super().__init__(max_batch, interval, outages)
        self.storage = storage
        self.engine = engine
        self._mutex = threading.RLock()  # the condition's lock, entered directly on the hot paths
        self._cond = threading.Condition(self._mutex)
        self._flushing = 0  # flush calls waiting
        self._thread: threading.Thread | None = None

    # -- public ----------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Attempts submitted and not sent yet (or being sent)."""
        with self._cond:
            return len(self._q.items) + self._lent + (1 if self._busy else 0)

    @property
    def queued(self) -> int:
        """Attempts submitted and waiting: neither lent to a claim nor being sent."""
        with self._cond:
            return len(self._q.items)

    def submit(self, claimed: ClaimedRuntimeJob, followups: Sequence[InsertParams] = ()) -> None:
        """Queue ``claimed`` for completion (with ``followups`` in its transaction)."""
        with self._mutex:
            if self._add(claimed, followups):
                self._cond.notify_all()

    def lend(self) -> list[Completion]:
        """Take the waiting completions without follow-ups (at most ``max_batch``) for a
        dispatcher to send with its claim; it must pass each to :meth:`settle_lent` or
        :meth:`return_lent`."""
        with self._mutex:
            return self._lend()

    def settle_lent(self, lent: Sequence[Completion], done: Sequence[tuple[int, int]]) -> None:
        """``lent`` went out with a claim that committed; ``done``: the pairs it completed
        (the others were stale)."""
        with self._cond:
            self._settle_lent(lent, done)
            if self._flushing:  # only a flush waits for lent completions (the sender does not)
                self._cond.notify_all()

    def return_lent(self, lent: Sequence[Completion]) -> None:
        """``lent`` could not be sent with a claim: the batcher sends them (due at once)."""
        with self._cond:
            self._return_lent(lent)
            self._cond.notify_all()

    def expect_claims(self, who: str, soon: bool) -> None:
        """Dispatcher ``who`` does (``soon``) or does not expect to claim again soon."""
        with self._cond:
            if soon:
                self._claimers.add(who)
            elif who in self._claimers:
                self._claimers.discard(who)
                self._cond.notify_all()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("batcher already running")
        self._stopping = False
        self._give_up_at = None
        self._thread = threading.Thread(target=self._loop, name="qstore-completions", daemon=True)
        self._thread.start()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is sent; True when nothing is pending."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._q.first_at = 0.0  # due now
            self._cond.notify_all()
            self._flushing += 1
            try:
                while self._q.items or self._busy or self._lent:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(min(remaining, 0.05))
            finally:
                self._flushing -= 1
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Send everything pending (retrying errors for up to ``timeout`` seconds), then end
        the thread. Attempts still unsent then are abandoned (counted, logged)."""
        with self._cond:
            self._stopping = True
            self._give_up_at = time.monotonic() + timeout
            self._q.first_at = 0.0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout + 1.0)
            self._thread = None
        with self._cond:
            self._left()

    # -- the thread ----------------------------------------------------------------------------
    def _next_batch(self) -> list[Completion] | None:
        with self._cond:
            while True:
                if not self._q.items:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                remaining = self._due() - time.monotonic()
                if len(self._q.items) >= self.max_batch or remaining <= 0 or self._stopping:
                    batch = self._take()
                    self._busy = True
                    return batch
                self._cond.wait(remaining)

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._send(batch)
            except Exception:  # never let the thread die with completions in hand
                log.exception("qstore worker: completion batch failed unexpectedly")
                self._count(abandoned=len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _wait_retry(self, delay: float) -> bool:
        """Sleep ``delay`` before a retry; False when the batcher must give up instead."""
        with self._cond:
            if self._give_up_at is not None:
                remaining = self._give_up_at - time.monotonic()
                if remaining <= 0:
                    return False
                delay = min(delay, remaining)
            self._cond.wait(delay)
        return True

    def _send(self, batch: list[Completion]) -> None:
        proc = self.send(batch)
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                effect = proc.throw(error) if error is not None else proc.send(value)
            except StopIteration:
                return
            value, error = None, None
            try:
                if isinstance(effect, RetryWait):
                    value = self._wait_retry(effect.delay)
                else:
                    value = getattr(self.storage, effect.op)(self.engine, *effect.args)
            except Exception as err:
                error = err



async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass (None: no limit); whether it
    is set."""
    if not event.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
    return event.is_set()


class AsyncCompletionBatcher(BatchCore):
    """:class:`CompletionBatcher` on an event loop: completes submitted attempts through
    ``storage`` (an :class:`~qstore.aio.AsyncQueueStorage`) on ``engine`` (an
    ``AsyncEngine``) from a task of the running loop. :meth:`submit` must be called on that
    loop; :meth:`start` starts the task, :meth:`stop` flushes and ends it. Sends, retries
    and counts exactly as :class:`CompletionBatcher` does (:class:`BatchCore`)."""

    def __init__(self, storage: AsyncQueueStorage, engine: AsyncEngine, *, max_batch: int = 500,
                 interval: float = 0.003, outages: OutageLog | None = None) -> None:
        super().__init__(max_batch, interval, outages)
        self.storage = storage
        self.engine = engine
        self._wake = asyncio.Event()  # something was queued, or the batcher is stopping
        self._settled = asyncio.Event()  # a batch was sent
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Attempts submitted and not sent yet (or being sent)."""
        return len(self._q.items) + self._lent + (1 if self._busy else 0)

    @property
    def queued(self) -> int:
        """Attempts submitted and waiting: neither lent to a claim nor being sent."""
        return len(self._q.items)

    def submit(self, claimed: ClaimedRuntimeJob, followups: Sequence[InsertParams] = ()) -> None:
        """Queue ``claimed`` for completion (with ``followups`` in its transaction)."""
        if self._add(claimed, followups):
            self._wake.set()

    def lend(self) -> list[Completion]:
        """As :meth:`CompletionBatcher.lend` (on the batcher's loop)."""
        return self._lend()

    def settle_lent(self, lent: Sequence[Completion], done: Sequence[tuple[int, int]]) -> None:
        """As :meth:`CompletionBatcher.settle_lent`."""
        self._settle_lent(lent, done)
        self._settled.set()

    def return_lent(self, lent: Sequence[Completion]) -> None:
        """As :meth:`CompletionBatcher.return_lent`."""
        self._return_lent(lent)
        self._wake.set()

    def expect_claims(self, who: str, soon: bool) -> None:
        """As :meth:`CompletionBatcher.expect_claims`."""
        if soon:
            self._claimers.add(who)
        elif who in self._claimers:
            self._claimers.discard(who)
            self._wake.set()

    def start(self) -> None:
        """Start the sending task on the running loop."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("batcher already running")
        self._stopping = False
        self._give_up_at = None
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="qstore-completions")

    async def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is sent; True when nothing is pending."""
        deadline = time.monotonic() + timeout
        self._q.first_at = 0.0  # due now
        self._wake.set()
        while self._q.items or self._busy or self._lent:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._settled.clear()
            await wait_event(self._settled, min(remaining, 0.05))
        return True

    async def stop(self, timeout: float = 10.0) -> None:
        """Send everything pending (retrying errors for up to ``timeout`` seconds), then end
        the task. Attempts still unsent then are abandoned (counted, logged)."""
        self._stopping = True
        self._give_up_at = time.monotonic() + timeout
        self._q.first_at = 0.0
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout + 1.0)
            except asyncio.TimeoutError:
                self._task.cancel()
            self._task = None
        self._left()

    async def _next_batch(self) -> list[Completion] | None:
        while True:
            if not self._q.items:
                if self._stopping:
                    return None
                self._wake.clear()
                await self._wake.wait()
                continue
            remaining = self._due() - time.monotonic()
            if len(self._q.items) >= self.max_batch or remaining <= 0 or self._stopping:
                self._busy = True
                return self._take()
            self._wake.clear()
            await wait_event(self._wake, remaining)

    async def _loop(self) -> None:
        while (batch := await self._next_batch()) is not None:
            try:
                await self._send(batch)
            except Exception:  # never let the task die with completions in hand
                log.exception("qstore worker: completion batch failed unexpectedly")
                self._count(abandoned=len(batch))
            finally:
                self._busy = False
                self._settled.set()

    async def _send(self, batch: list[Completion]) -> None:
        proc = self.send(batch)
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                effect = proc.throw(error) if error is not None else proc.send(value)
            except StopIteration:
                return
            value, error = None, None
            try:
                if isinstance(effect, RetryWait):
                    value = await self._wait_retry(effect.delay)
                else:
                    value = await getattr(self.storage, effect.op)(self.engine, *effect.args)
            except Exception as err:
                error = err

    async def _wait_retry(self, delay: float) -> bool:
        """Sleep ``delay`` before a retry; False when the batcher must give up instead."""
        if self._give_up_at is not None:
            remaining = self._give_up_at - time.monotonic()
            if remaining <= 0:
                return False
            delay = min(delay, remaining)
        self._wake.clear()
        await wait_event(self._wake, delay)
        return True
