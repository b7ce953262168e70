"""Tasks: functions registered under a job kind, deferred as jobs and run by a worker.

``App(storage)`` is the registry of one install's tasks. ``@app.task(...)`` turns a function
``fn(ctx, **args)`` (or ``async def``) into a :class:`Task`: still callable directly, and
able to *defer* itself as a job whose JSON args are the function's keyword arguments::

    app = App(storage)

    @app.task(queue="mail", priority=1)
    def send_email(ctx: JobContext, to: str) -> None: ...

    send_email.defer(engine, to="a@example.com")         # one job, one round trip
    send_email.configure(delay=60).defer(session, to="b@example.com")  # in your transaction

``defer`` is exactly :meth:`QueueStorage.enqueue` (``defer_many``: ``enqueue_many``): on an
``Engine`` one autocommitted round trip, on a ``Connection`` or ``Session`` one statement in
the caller's transaction, which commits or rolls back with it. Arguments are bound against
the function's signature before anything is sent, so a missing or unknown argument is a
:class:`~qstore.errors.ValidationError` naming it.

A handler ends its attempt by returning (the job completes) or raising (the job is retried
after the storage's backoff, or fails for good once its attempts are exhausted), or by
returning *or* raising one of the outcomes below; :mod:`qstore.runtime.worker` applies them:

==============================  ==============================================================
``Snooze(seconds)``             run again later; the attempt is given back (``snooze``)
``RetryAfter(seconds)``         retryable, due in ``seconds`` (``retry_after``)
``Cancel(reason)``              cancelled, terminal (``cancel_running``)
``Fail(error, dlq=False)``      failed for good (``fail_terminal``) or into the DLQ
                                (``fail_to_dlq``)
``WaitForCallback(...)``        park on an external callback (``register_callback`` +
                                ``enter_callback_wait``); ``complete_external`` /
                                ``fail_external`` finish the job
==============================  ==============================================================
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from sqlalchemy import Engine

from qstore.errors import CallbackWaitEndedError, ValidationError
from qstore.runtime.periodic import Periodic, schedule_of, tick_of, validate_catch_up
from qstore.runtime.telemetry import Telemetry, default_telemetry
from qstore.storage import QueueStorage
from qstore.storage.enqueue import DeferredJob, KeptValues
from qstore.storage.jobs import (
    validate_aware_datetime,
    validate_kind,
    validate_priority,
    validate_queue,
)
from qstore.storage.targets import AsyncTarget, Target
from qstore.types import (
    CallbackPollKind,
    ClaimedRuntimeJob,
    InsertOpts,
    InsertParams,
    JobRow,
    UniqueOpts,
)

if TYPE_CHECKING:
    from qstore.aio import AsyncQueueStorage

__all__ = [
    "App",
    "Cancel",
    "Deferral",
    "Fail",
    "JobContext",
    "JobOutcome",
    "RetryAfter",
    "Snooze",
    "Task",
    "WaitForCallback",
]

P = ParamSpec("P")
R = TypeVar("R")

#: Longest delay an outcome accepts (the storage's interval arguments are bounded too).
MAX_DELAY_SECONDS = 10 * 365 * 86400.0


def _seconds(value: object, field: str, *, positive: bool = False) -> float:
    """``value`` (seconds as a number, or a ``timedelta``) as finite seconds >= 0 (> 0 when
    ``positive``), at most ``MAX_DELAY_SECONDS``."""
    if isinstance(value, timedelta):
        number = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValidationError(field, value, "must be a number of seconds or a timedelta")
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValidationError(field, value, "must be a finite number of seconds "
                              + ("> 0" if positive else ">= 0"))
    if number > MAX_DELAY_SECONDS:
        raise ValidationError(field, value, f"must be at most {MAX_DELAY_SECONDS:.0f} seconds")
    return number


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(field, value, "must be a string")
    return value


# -- outcomes ------------------------------------------------------------------------------------


class JobOutcome(Exception):
    """Base of the outcomes a handler may return or raise instead of completing."""


class Snooze(JobOutcome):
    """Run the job again in ``seconds``; this attempt is given back (it does not count)."""

    def __init__(self, seconds: float | timedelta) -> None:
        self.seconds = _seconds(seconds, "seconds")
        super().__init__(f"snooze for {self.seconds:g}s")


class RetryAfter(JobOutcome):
    """End this attempt as retryable, due in ``seconds`` (the attempt counts)."""

    def __init__(self, seconds: float | timedelta) -> None:
        self.seconds = _seconds(seconds, "seconds")
        super().__init__(f"retry after {self.seconds:g}s")


class Cancel(JobOutcome):
    """Cancel the job (terminal), recording ``reason``."""

    def __init__(self, reason: str = "") -> None:
        self.reason = _text(reason, "reason")
        super().__init__(f"cancel: {reason}" if reason else "cancel")


class Fail(JobOutcome):
    """Fail the job for good with ``error`` (no retry, whatever attempts are left); with
    ``dlq=True`` it goes to the dead-letter queue instead, with ``dlq_reason``."""

    def __init__(self, error: str, *, dlq: bool = False, dlq_reason: str = "failed by handler") -> None:
        self.error = _text(error, "error")
        self.dlq = bool(dlq)
        self.dlq_reason = _text(dlq_reason, "dlq_reason")
        super().__init__(error)


class WaitForCallback(JobOutcome):
    """Park the job on an external callback: it leaves the worker (``waiting_external``)
    and is finished from outside with ``complete_external`` / ``fail_external`` (or
    rescued when ``timeout`` passes).

    Pass the ``callback_id`` that :meth:`JobContext.register_callback` returned (and that
    you handed to the outside system), or none: the worker then registers one with
    ``timeout`` itself (read it back with ``load_job(...).callback_id``).
    """

    def __init__(self, callback_id: uuid.UUID | str | None = None, *,
                 timeout: float | timedelta = 3600.0) -> None:
        if callback_id is not None and not isinstance(callback_id, uuid.UUID):
            try:
                callback_id = uuid.UUID(str(callback_id))
            except ValueError:
                raise ValidationError("callback_id", callback_id, "must be a UUID") from None
        self.callback_id: uuid.UUID | None = callback_id
        self.timeout = _seconds(timeout, "timeout", positive=True)
        super().__init__(f"wait for callback {callback_id}" if callback_id else "wait for a callback")


# -- the context of one attempt ---------------------------------------------------------------------

_UNSET: Any = object()


class JobContext:
    """What a handler gets for one attempt: the claimed job, the storage, a cancellation
    flag, and helpers that act on this attempt.

    ``cancelled`` is set when the attempt was closed under the handler: an operator
    cancelled the job, the task's deadline passed, or the worker is shutting down and gave
    the attempt back. A long handler should check it (``ctx.is_cancelled``) and return; what
    it returns afterwards is ignored (the attempt is closed already). Async handlers are
    also cancelled (``asyncio.CancelledError``).
    """

    def __init__(self, claimed: ClaimedRuntimeJob, storage: QueueStorage, engine: Engine | None = None,
                 *, cancelled: threading.Event | None = None) -> None:
        self.claimed = claimed
        self.storage = storage
        self.engine = engine
        self._cancelled = cancelled  # made on first use: most attempts are never cancelled
        self.cancel_reason: str | None = None
        self.progress: Any = None
        self.followups: list[InsertParams] = []
        self._lock = threading.Lock()
        self._wait_began: float | None = None
        self._waited = 0.0

    # -- the attempt ---------------------------------------------------------------------------
    @property
    def job(self) -> JobRow:
        return self.claimed.job

    @property
    def job_id(self) -> int:
        return self.claimed.job.id

    @property
    def run_lease(self) -> int:
        return self.claimed.job.run_lease

    @property
    def attempt(self) -> int:
        return self.claimed.job.attempt

    @property
    def kind(self) -> str:
        return self.claimed.job.kind

    @property
    def queue(self) -> str:
        return self.claimed.job.queue

    @property
    def args(self) -> Any:
        return self.claimed.job.args

    @property
    def tick(self) -> datetime | None:
        """The tick (aware UTC datetime) a periodic task's job was enqueued for, None for a
        job that no schedule enqueued. It stays the same through retries and snoozes."""
        return tick_of(self.claimed.job.metadata)

    @property
    def cancelled(self) -> threading.Event:
        """Set once the attempt was closed under the handler (see the class docstring)."""
        event = self._cancelled
        if event is None:
            with self._lock:
                if self._cancelled is None:
                    self._cancelled = threading.Event()
                event = self._cancelled
        return event

    @property
    def is_cancelled(self) -> bool:
        event = self._cancelled
        return event is not None and event.is_set()

    def cancel(self, reason: str) -> None:
        """Mark the attempt as closed under the handler (used by the worker)."""
        with self._lock:
            if self.cancel_reason is None:
                self.cancel_reason = reason
        self.cancelled.set()

    # -- helpers ---------------------------------------------------------------------------------
    def _engine(self) -> Engine:
        if self.engine is None:
            raise ValidationError("ctx.engine", None, "this context has no engine to act on the attempt")
        return self.engine

    def set_progress(self, progress: Any) -> None:
        """Record ``progress`` (JSON): the worker sends it with its next batched heartbeat
        and with a retry, snooze or failure of this attempt (a completion clears it)."""
        self.progress = progress

    def heartbeat(self, progress: Any = _UNSET) -> bool:
        """Heartbeat this attempt now (one round trip), storing ``progress`` when given.
        False when the attempt is no longer live (rescued, cancelled): stop working."""
        if progress is not _UNSET:
            self.progress = progress
            n = self.storage.heartbeat_progress_batch(self._engine(), [(self.job_id, self.run_lease, progress)])
        else:
            n = self.storage.heartbeat_batch(self._engine(), [(self.job_id, self.run_lease)])
        return n > 0

    def register_callback(self, timeout: float | timedelta = 3600.0) -> uuid.UUID:
        """Register an external callback for this attempt and return its id: hand it to the
        outside system, then return ``WaitForCallback(callback_id)``."""
        seconds = _seconds(timeout, "timeout", positive=True)
        return self.storage.register_callback(self._engine(), self.job_id, self.run_lease, seconds)

    def wait_for_callback(self, callback_id: uuid.UUID, *, poll_interval: float = 0.5) -> Any:
        """Wait in the handler until the outside system resumes this attempt with
        ``complete_external(callback_id, payload, resume=True)``, and return ``payload``.

        Register first (``callback_id = ctx.register_callback(timeout=...)``) and hand the id
        out. The attempt waits as ``waiting_external`` (its heartbeat and deadline are off,
        the callback's timeout applies) and runs again once resumed; this handler then goes
        on and its outcome is written as usual. Polls every ``poll_interval`` seconds (one
        round trip each). Raises :class:`~qstore.errors.CallbackWaitEndedError` when the
        attempt stopped waiting on this callback in any other way (timed out and rescued,
        failed or retried from outside) or was closed under the handler (``is_cancelled``).
        The task's ``deadline`` does not count the wait (the callback's timeout bounds it).
        Blocks the calling thread: ``async def`` handlers use
        :meth:`wait_for_callback_async`."""
        interval = _seconds(poll_interval, "poll_interval", positive=True)
        engine = self._engine()
        with self._waiting():
            self.storage.enter_callback_wait(engine, self.job_id, self.run_lease, callback_id)
            while True:
                found = self._callback_result(engine, callback_id)
                if found is not _UNSET:
                    return found
                if self.cancelled.wait(interval):
                    raise CallbackWaitEndedError(callback_id, "cancelled")

    async def wait_for_callback_async(self, callback_id: uuid.UUID, *, poll_interval: float = 0.5) -> Any:
        """:meth:`wait_for_callback` for ``async def`` handlers: the same calls, run off the
        event loop, and ``asyncio.sleep`` between polls (a cancelled task stops waiting)."""
        interval = _seconds(poll_interval, "poll_interval", positive=True)
        engine = self._engine()
        with self._waiting():
            await asyncio.to_thread(self.storage.enter_callback_wait, engine, self.job_id, self.run_lease,
                                    callback_id)
            while True:
                found = await asyncio.to_thread(self._callback_result, engine, callback_id)
                if found is not _UNSET:
                    return found
                if self.is_cancelled:
                    raise CallbackWaitEndedError(callback_id, "cancelled")
                await asyncio.sleep(interval)

    def waited(self, now: float) -> tuple[bool, float]:
        """Whether the handler is waiting for its callback at ``now`` (``time.monotonic()``),
        and the seconds it has spent waiting so far: a task's deadline counts neither."""
        began = self._wait_began
        return began is not None, self._waited + (now - began if began is not None else 0.0)

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        """Time spent inside is waiting time (see :meth:`waited`)."""
        self._wait_began = began = time.monotonic()
        try:
            yield
        finally:
            self._waited += time.monotonic() - began
            self._wait_began = None

    def _callback_result(self, engine: Engine, callback_id: uuid.UUID) -> Any:
        """The resumed payload, ``_UNSET`` while still waiting; raises when the wait ended."""
        poll = self.storage.check_callback_state(engine, self.job_id, callback_id)
        if poll.kind is CallbackPollKind.RESOLVED:
            return poll.payload
        if poll.kind is CallbackPollKind.PENDING:
            return _UNSET
        raise CallbackWaitEndedError(callback_id, poll.kind.value, poll.state)

    def defer(self, task: Task[Any, Any] | Deferral, /, *args: Any, **kwargs: Any) -> None:
        """Enqueue a follow-up job *with this attempt's completion*: the worker writes it in
        the transaction that completes this attempt, so both commit or neither does (a
        failed or stale completion enqueues nothing). Ignored unless the handler completes."""
        deferral = task if isinstance(task, Deferral) else task.deferral
        self.followups.append(deferral.params(*args, **kwargs))

    def defer_params(self, params: InsertParams) -> None:
        """:meth:`defer` for a job of any kind (``InsertParams``), e.g. one no task of this
        app handles."""
        if not isinstance(params, InsertParams):
            raise ValidationError("params", params, "expected InsertParams")
        self.followups.append(params)

    def __repr__(self) -> str:
        return f"JobContext(job_id={self.job_id}, kind={self.kind!r}, attempt={self.attempt})"


# -- tasks -------------------------------------------------------------------------------------------


def _binder(fn: Callable[..., Any], field: str) -> inspect.Signature:
    """The signature of ``fn`` minus its first parameter (the context); refuses functions
    whose arguments cannot be a JSON object."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValidationError(field, fn, "has no inspectable signature") from None
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise ValidationError(field, fn, "must take the JobContext as its first positional argument")
    rest = params[1:]
    for p in rest:
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise ValidationError(field, fn, f"argument {p.name!r} cannot be passed by name: job "
                                  "args are a JSON object, so every argument after the context "
                                  "must be passable as a keyword")
    return sig.replace(parameters=rest)


class _Keywords:
    """The parameters of a task's signature as :meth:`Deferral.args_of` reads a call made of
    keywords alone: ``names`` in signature order (None when the function takes
    ``**kwargs``), the ``known`` ones and the ``required`` ones (without a default). A call
    whose keywords are known names and include every required one binds each keyword to
    its own name, as ``Signature.bind`` would; any other call goes through ``bind``, which
    words the errors."""

    __slots__ = ("known", "names", "required", "signature")

    def __init__(self, signature: inspect.Signature) -> None:
        params = list(signature.parameters.values())
        self.signature = signature
        self.names: tuple[str, ...] | None = tuple(p.name for p in params)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self.names = None
        self.known = frozenset(p.name for p in params)
        self.required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)


@dataclass(frozen=True)
class Deferral:
    """A task with fixed insert options (what :meth:`Task.configure` returns): defers jobs
    like the task does, with these options."""

    task: Task[Any, Any]
    opts: InsertOpts
    delay: float | None = None
    #: what the storage keeps of this deferral's jobs to write the next one with less work
    #: (see :class:`~qstore.storage.enqueue.DeferredJob`)
    _kept: KeptValues = field(default_factory=KeptValues, init=False, repr=False, compare=False)

    def args_of(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The job args (a JSON object) for a call ``fn(ctx, *args, **kwargs)``; a missing
        or unknown argument is a ``ValidationError`` naming it."""
        task = self.task
        shape = task._keywords
        if not args and shape.names is not None and shape.signature is task.signature:
            given = kwargs.keys()
            if given <= shape.known and shape.required <= given:
                return {name: kwargs[name] for name in shape.names if name in kwargs}
        try:
            bound = self.task.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise ValidationError(f"{self.task.kind}.args", kwargs or args, str(err)) from None
        out: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.task.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out

    def params(self, *args: Any, **kwargs: Any) -> InsertParams:
        """The :class:`InsertParams` of one job (nothing is sent)."""
        opts = self.opts
        if self.delay is not None:
            opts = replace(opts, run_at=datetime.now(timezone.utc) + timedelta(seconds=self.delay))
        return InsertParams(self.task.kind, self.args_of(*args, **kwargs), opts)

    def _many(self, items: Sequence[Mapping[str, Any]]) -> list[InsertParams]:
        if isinstance(items, Mapping | str) or not isinstance(items, Sequence):
            raise ValidationError("items", items, "expected a list of keyword-argument mappings")
        jobs = []
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise ValidationError(f"items[{i}]", item, "expected a mapping of keyword arguments")
            jobs.append(self.params(**item))
        return jobs

    @contextmanager
    def _traced(self, jobs: list[InsertParams]) -> Iterator[list[InsertParams]]:
        """``jobs`` as they are enqueued under the app's telemetry: inside its producer span,
        each carrying the span's trace context in its metadata (unchanged without one)."""
        telemetry = self.task.app.telemetry
        if not telemetry.enabled or not jobs or not telemetry.recording:
            yield jobs
            return
        with self._spanned(jobs) as traced:
            yield traced

    @contextmanager
    def _spanned(self, jobs: list[InsertParams]) -> Iterator[list[InsertParams]]:
        """:meth:`_traced` once the telemetry is known to record: the producer span."""
        with self.task.app.telemetry.deferring(self.opts.queue, self.task.kind, self.opts.metadata,
                                               len(jobs)) as carried:
            if carried is self.opts.metadata:
                yield jobs
            else:
                extra = {k: v for k, v in carried.items() if k not in self.opts.metadata}
                yield [replace(j, opts=replace(j.opts, metadata={**j.opts.metadata, **extra})) for j in jobs]

    def _job(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InsertParams:
        """:meth:`params`, as the :class:`~qstore.storage.enqueue.DeferredJob` of this
        deferral when it has no delay (a delay gives every job options of its own)."""
        if self.delay is None:
            return DeferredJob(self.task.kind, self.args_of(*args, **kwargs), self.opts, self._kept)
        return self.params(*args, **kwargs)

    def defer(self, target: Target, /, *args: Any, **kwargs: Any) -> int:
        """Enqueue one job (``QueueStorage.enqueue``) and return its id."""
        job = self._job(args, kwargs)
        app = self.task.app
        telemetry = app.telemetry
        if not telemetry.enabled or not telemetry.recording:  # as _traced yields it, without its generator
            return app.storage.enqueue(target, job)
        with self._spanned([job]) as jobs:
            return app.storage.enqueue(target, jobs[0])

    def defer_many(self, target: Target, items: Sequence[Mapping[str, Any]], /) -> list[int]:
        """Enqueue one job per mapping of keyword arguments, in one statement
        (``QueueStorage.enqueue_many``); returns their ids in order."""
        with self._traced(self._many(items)) as jobs:
            return self.task.app.storage.enqueue_many(target, jobs)

    async def defer_async(self, target: AsyncTarget, /, *args: Any, **kwargs: Any) -> int:
        """``defer`` on an ``AsyncEngine``, ``AsyncConnection`` or ``AsyncSession``."""
        with self._traced([self._job(args, kwargs)]) as jobs:
            return await self.task.app.async_storage.enqueue(target, jobs[0])

    async def defer_many_async(self, target: AsyncTarget, items: Sequence[Mapping[str, Any]], /) -> list[int]:
        """``defer_many`` on an async target."""
        with self._traced(self._many(items)) as jobs:
            return await self.task.app.async_storage.enqueue_many(target, jobs)


class Task(Generic[P, R]):
    """A function registered under a job kind (see the module docstring). Call it directly
    as ``task(ctx, **args)``; defer it as a job with :meth:`defer`."""

    def __init__(self, app: App, fn: Callable[Concatenate[JobContext, P], R], *, kind: str,
                 opts: InsertOpts, deadline: float | None) -> None:
        self.app = app
        self.fn = fn
        self.kind = kind
        self.signature = _binder(fn, "task")
        self._keywords = _Keywords(self.signature)
        self.is_async = inspect.iscoroutinefunction(fn)
        self.deadline = deadline
        self.deferral = Deferral(self, opts)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", kind)
        self.__qualname__ = getattr(fn, "__qualname__", kind)
        self.__module__ = getattr(fn, "__module__", __name__)
        self.__wrapped__ = fn

    @property
    def opts(self) -> InsertOpts:
        return self.deferral.opts

    @property
    def queue(self) -> str:
        return self.deferral.opts.queue

    def __call__(self, ctx: JobContext, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(ctx, *args, **kwargs)

    def configure(self, *, queue: str | None = None, priority: int | None = None,
                  delay: float | timedelta | None = None, run_at: datetime | None = None,
                  max_attempts: int | None = None, unique: UniqueOpts | None = None,
                  tags: Sequence[str] | None = None, metadata: Mapping[str, Any] | None = None,
                  ordering_key: bytes | None = None) -> Deferral:
        """The task with other insert options for the jobs deferred through the result;
        ``delay`` (seconds or a timedelta, from the moment of each ``defer``) and
        ``run_at`` (an aware datetime) schedule the job instead of making it ready."""
        if delay is not None and run_at is not None:
            raise ValidationError("delay", delay, "give delay or run_at, not both")
        changes: dict[str, Any] = {}
        if queue is not None:
            changes["queue"] = validate_queue(queue)
        if priority is not None:
            changes["priority"] = validate_priority(priority)
        if run_at is not None:
            changes["run_at"] = validate_aware_datetime(run_at, "run_at")
        if max_attempts is not None:
            changes["max_attempts"] = max_attempts
        if unique is not None:
            changes["unique"] = unique
        if tags is not None:
            changes["tags"] = tuple(tags)
        if metadata is not None:
            changes["metadata"] = dict(metadata)
        if ordering_key is not None:
            changes["ordering_key"] = ordering_key
        seconds = None if delay is None else _seconds(delay, "delay")
        return Deferral(self, replace(self.opts, **changes), seconds)

    def params(self, *args: P.args, **kwargs: P.kwargs) -> InsertParams:
        """The :class:`InsertParams` of one job of this task (nothing is sent)."""
        return self.deferral.params(*args, **kwargs)

    def defer(self, target: Target, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue one job (exactly ``QueueStorage.enqueue``: one round trip on an
        ``Engine``, one statement in a caller's ``Connection`` / ``Session``); its id."""
        return self.deferral.defer(target, *args, **kwargs)

    def defer_many(self, target: Target, items: Sequence[Mapping[str, Any]], /) -> list[int]:
        """Enqueue one job per mapping of keyword arguments in one statement; their ids."""
        return self.deferral.defer_many(target, items)

    async def defer_async(self, target: AsyncTarget, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """``defer`` on an ``AsyncEngine``, ``AsyncConnection`` or ``AsyncSession``."""
        return await self.deferral.defer_async(target, *args, **kwargs)

    async def defer_many_async(self, target: AsyncTarget, items: Sequence[Mapping[str, Any]], /) -> list[int]:
        """``defer_many`` on an async target."""
        return await self.deferral.defer_many_async(target, items)

    def __repr__(self) -> str:
        return f"<Task {self.kind!r} queue={self.queue!r}{' async' if self.is_async else ''}>"


class App:
    """The tasks of one install (``storage``), by kind. A worker runs the tasks of one app."""

    def __init__(self, storage: QueueStorage, *, telemetry: Telemetry | None = None) -> None:
        """``telemetry`` receives the metrics and traces of this app's deferrals and of the
        workers that run it (default: :func:`~qstore.runtime.telemetry.default_telemetry`,
        OpenTelemetry when the ``otel`` extra is installed, nothing otherwise)."""
        if not isinstance(storage, QueueStorage):
            raise ValidationError("storage", storage, "expected QueueStorage")
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise ValidationError("telemetry", telemetry, "expected a qstore Telemetry")
        self.storage = storage
        self.telemetry = telemetry if telemetry is not None else default_telemetry()
        self.tasks: dict[str, Task[Any, Any]] = {}
        self.periodic_tasks: dict[str, Periodic] = {}
        self._async: AsyncQueueStorage | None = None

    @property
    def async_storage(self) -> AsyncQueueStorage:
        """The async face of :attr:`storage` (same install, same routing state)."""
        if self._async is None:
            from qstore.aio import AsyncQueueStorage

            self._async = AsyncQueueStorage(self.storage)
        return self._async

    @property
    def queues(self) -> list[str]:
        """The queues of the registered tasks, sorted."""
        return sorted({t.queue for t in self.tasks.values()})

    def get(self, kind: str) -> Task[Any, Any] | None:
        return self.tasks.get(kind)

    @overload
    def task(self, fn: Callable[Concatenate[JobContext, P], R], /) -> Task[P, R]: ...
    @overload
    def task(self, fn: None = None, /, *, kind: str | None = None, queue: str = "default", priority: int = 2,
             max_attempts: int = 25, unique: UniqueOpts | None = None,
             deadline: float | timedelta | None = None
             ) -> Callable[[Callable[Concatenate[JobContext, P], R]], Task[P, R]]: ...

    def task(self, fn: Callable[..., Any] | None = None, /, *, kind: str | None = None,
             queue: str = "default", priority: int = 2, max_attempts: int = 25,
             unique: UniqueOpts | None = None, deadline: float | timedelta | None = None) -> Any:
        """Register ``fn`` as a task (``@app.task`` or ``@app.task(...)``).

        ``kind`` defaults to ``module.qualname`` of the function; ``queue``, ``priority``,
        ``max_attempts`` and ``unique`` are the defaults of its jobs' insert options.
        ``deadline`` (seconds): a worker closes an attempt still running after that long as
        a retryable failure and sets ``ctx.cancelled`` (async handlers are cancelled).
        """
        opts = InsertOpts(queue=validate_queue(queue), priority=validate_priority(priority),
                          max_attempts=max_attempts, unique=unique)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValidationError("max_attempts", max_attempts, "must be a positive integer")
        if unique is not None and not isinstance(unique, UniqueOpts):
            raise ValidationError("unique", unique, "expected UniqueOpts or None")
        limit = None if deadline is None else _seconds(deadline, "deadline", positive=True)

        def register(f: Callable[..., Any]) -> Task[Any, Any]:
            if not callable(f):
                raise ValidationError("task", f, "must be a function")
            name = validate_kind(kind if kind is not None else
                                 f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}")
            if name in self.tasks:
                raise ValidationError("kind", name, "a task of this kind is registered already")
            task: Task[Any, Any] = Task(self, f, kind=name, opts=opts, deadline=limit)
            self.tasks[name] = task
            return task

        return register(fn) if fn is not None else register

    def periodic(self, *, cron: str | None = None, every: float | timedelta | None = None,
                 catch_up: int = 0, args: Mapping[str, Any] | None = None) -> _PeriodicDecorator:
        """Run a task on a schedule: ``cron="*/5 * * * *"`` (a cron expression in UTC; needs
        the ``cron`` extra) or ``every=timedelta(seconds=30)`` (an interval: ticks at its
        multiples since the Unix epoch). Stack it on ``@app.task(...)``, or put it on a plain
        function to register that as a task with the default options.

        Each tick is enqueued as one job (``args`` are its fixed keyword arguments), exactly
        once however many workers run; the handler reads the tick as ``ctx.tick``. Ticks
        whose time passed while no worker planned them are skipped, unless ``catch_up=N``:
        then the newest ``N`` of them are enqueued when a worker comes back (see
        :mod:`qstore.runtime.periodic`). The task stays a normal task: callable, deferrable.

        Raises ``ValidationError`` for a bad schedule, ``catch_up`` or ``args`` (at
        decoration), and :class:`~qstore.errors.MissingExtraError` for ``cron=``
        without the ``croniter`` package.
        """
        schedule = schedule_of(cron=cron, every=every)
        catch = validate_catch_up(catch_up)
        if args is not None and not isinstance(args, Mapping):
            raise ValidationError("args", args, "expected a mapping of keyword arguments")

        def register(target: Any) -> Task[Any, Any]:
            task = target if isinstance(target, Task) else self.task(target)
            if task.app is not self:
                raise ValidationError("task", task, "is registered with another App")
            if task.kind in self.periodic_tasks:
                raise ValidationError("kind", task.kind, "this task has a schedule already")
            fixed = task.deferral.args_of(**dict(args or {}))
            self.periodic_tasks[task.kind] = Periodic(task.kind, schedule, task.opts, fixed, catch)
            return task

        return register

    def __repr__(self) -> str:
        return f"App({self.storage!r}, tasks={sorted(self.tasks)})"


class _PeriodicDecorator(Protocol):
    """What ``@app.periodic(...)`` returns: takes a task (or a function to register as one)
    and returns the task."""

    @overload
    def __call__(self, target: Task[P, R], /) -> Task[P, R]: ...
    @overload
    def __call__(self, target: Callable[Concatenate[JobContext, P], R], /) -> Task[P, R]: ...

