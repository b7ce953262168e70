"""Periodic tasks: schedules (cron expressions or fixed intervals), their ticks, and the
planner that enqueues each tick exactly once however many workers run.

A periodic task is a normal task with a :class:`Periodic` attached
(``@app.periodic(every=...)`` or ``@app.periodic(cron=...)``, see
:meth:`qstore.runtime.tasks.App.periodic`). Its **ticks** are the instants its schedule
names, in UTC: an interval's ticks are the multiples of the interval since the Unix epoch
(so every process computes the same ticks, whenever it started), a cron expression's ticks
are the times it matches.

Each tick becomes one job: the task's kind, queue and options, the periodic args, ``run_at``
the tick (the job is ``scheduled`` until then and the maintainer promotes it when due), the
tick in the job's metadata (``_qstore_tick``, read back as ``ctx.tick``), and a unique key
made of the kind and the tick, held in every state until the job's history is pruned. A
second enqueue of the same tick, by any process, is refused by that key and writes nothing.

The :class:`Planner` runs in every worker whose app has periodic tasks. For each periodic
kind it competes for a session advisory lock (one autocommit connection per planner, no
open transaction); the holder plans that kind:

* it keeps the kind's **next tick** enqueued ahead of time: when a tick's time has come, it
  enqueues the first tick after now;
* a tick is never enqueued once its time has passed, except as **catch-up**: ticks *missed*
  are the ticks at or before now that no planner enqueued (a planner that held the lock
  throughout knows them; a planner that takes a kind over and finds its next tick not
  enqueued yet counts back from now, newest first, until a tick whose job is still in the
  database), and ``catch_up=N`` enqueues the newest ``N`` of them. With ``catch_up=0`` (the
  default) they are skipped.

Exactly once therefore rests on the unique keys, not on the lock: two planners that both
believe they lead (the lock's session died and another took it before the first noticed)
enqueue the same tick once between them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Connection, Engine, func, literal, select

from qstore.errors import QueueStorageError, UniqueConflictError, ValidationError
from qstore.outage import OutageLog
from qstore.storage import QueueStorage
from qstore.storage.jobs import validate_json
from qstore.types import InsertOpts, InsertParams, UniqueOpts

__all__ = [
    "TICK_KEY",
    "Cron",
    "Every",
    "MissingExtraError",
    "Periodic",
    "Planned",
    "Planner",
    "Schedule",
    "schedule_of",
    "tick_id",
    "tick_of",
]

log = logging.getLogger("qstore.worker")

#: The job metadata key that carries a periodic job's tick (ISO 8601, UTC).
TICK_KEY = "_qstore_tick"
#: A tick job holds its unique key in every state (until its history is pruned).
TICK_KEY_STATES = 0xFF
#: Prefix of a periodic kind's lock key (followed by the schema and the kind).
LOCK_KEY_PREFIX = "qstore:periodic:1:"
#: Shortest interval (seconds) and the most missed ticks a task may replay.
MIN_EVERY = 1.0
MAX_EVERY = 10 * 366 * 86400.0
MAX_CATCH_UP = 1000
#: How often a planner tries to take the kinds it does not lead, and checks that its lock's
#: session is alive (seconds); and how long it waits after a failed pass.
LOCK_RETRY = 1.0
ERROR_RETRY = 1.0

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


class MissingExtraError(QueueStorageError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the
    extra that installs it (``pip install 'qstore[cron]'``)."""

    def __init__(self, feature: str, extra: str, package: str) -> None:
        self.feature = feature
        self.extra = extra
        self.package = package
        super().__init__(f"{feature} needs the {package} package, which is not installed; "
                         f"install it with the extra: pip install 'qstore[{extra}]'")


def _micros(t: datetime) -> int:
    return (t - _EPOCH) // _MICROSECOND


def tick_id(tick: datetime) -> int:
    """The tick as whole microseconds since the Unix epoch (the tick's part of its job's
    unique key)."""
    return _micros(tick)


def _utc(t: datetime, field_name: str = "now") -> datetime:
    if not isinstance(t, datetime) or t.tzinfo is None or t.utcoffset() is None:
        raise ValidationError(field_name, t, "must be a timezone-aware datetime")
    return t.astimezone(timezone.utc)


class Schedule:
    """When a periodic task ticks. Ticks are aware UTC datetimes."""

    def next_after(self, t: datetime) -> datetime:
        """The first tick strictly after ``t``."""
        raise NotImplementedError

    def at_or_before(self, t: datetime) -> datetime:
        """The last tick at or before ``t``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Every(Schedule):
    """A fixed interval: ticks at the multiples of ``seconds`` since the Unix epoch (UTC), so
    ``Every(30)`` ticks at :00 and :30 of every minute and ``Every(3600)`` on the hour."""

    seconds: float

    def __post_init__(self) -> None:
        value = self.seconds
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValidationError("every", value, "must be a number of seconds or a timedelta")
        if not MIN_EVERY <= value <= MAX_EVERY:
            raise ValidationError("every", value, f"must be between {MIN_EVERY:g} second and "
                                  f"{MAX_EVERY:.0f} seconds")

    @property
    def _period(self) -> int:
        return round(self.seconds * 1_000_000)

    def next_after(self, t: datetime) -> datetime:
        us = _micros(_utc(t))
        return _EPOCH + (us // self._period + 1) * self._period * _MICROSECOND

    def at_or_before(self, t: datetime) -> datetime:
        us = _micros(_utc(t))
        return _EPOCH + (us // self._period) * self._period * _MICROSECOND

    def __str__(self) -> str:
        return f"every {self.seconds:g}s"


@dataclass(frozen=True)
class Cron(Schedule):
    """A cron expression, evaluated in UTC by the ``croniter`` package (the ``cron`` extra):
    five fields (minute hour day-of-month month day-of-week), an optional sixth field for
    seconds and a seventh for the year, or a nickname such as ``@hourly``."""

    expression: str

    def __post_init__(self) -> None:
        expr = self.expression
        if not isinstance(expr, str) or not expr.strip():
            raise ValidationError("cron", expr, "must be a cron expression such as '*/5 * * * *'")
        croniter = _croniter()
        try:
            croniter(expr, _EPOCH).get_next(datetime)
        except Exception as err:  # croniter's errors are ValueError / KeyError subclasses
            raise ValidationError("cron", expr, f"not a valid cron expression: {err}") from None

    def next_after(self, t: datetime) -> datetime:
        t = _utc(t)
        # croniter counts in whole seconds: step from the second that holds ``t``
        base = t.replace(microsecond=0)
        nxt = _croniter()(self.expression, base).get_next(datetime)
        return _utc(nxt)

    def at_or_before(self, t: datetime) -> datetime:
        following = self.next_after(t)
        return _utc(_croniter()(self.expression, following).get_prev(datetime))

    def __str__(self) -> str:
        return f"cron {self.expression!r}"


def _croniter() -> Any:
    try:
        from croniter import croniter
    except ImportError:
        raise MissingExtraError("a cron schedule (cron=...)", "cron", "croniter") from None
    return croniter


def schedule_of(*, cron: str | None = None, every: float | timedelta | None = None) -> Schedule:
    """The schedule of ``cron=`` or ``every=`` (exactly one); a bad value is a
    ``ValidationError`` naming it, a cron schedule without croniter a
    :class:`MissingExtraError`."""
    if (cron is None) == (every is None):
        raise ValidationError("periodic", {"cron": cron, "every": every},
                              "give exactly one of cron= (an expression) or every= (an interval)")
    if cron is not None:
        return Cron(cron)
    if isinstance(every, timedelta):
        return Every(every.total_seconds())
    return Every(every)  # type: ignore[arg-type]


def validate_catch_up(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CATCH_UP:
        raise ValidationError("catch_up", value, f"must be an integer between 0 and {MAX_CATCH_UP}")
    return value


def tick_of(metadata: Mapping[str, Any] | None) -> datetime | None:
    """The tick a periodic job was enqueued for (from its metadata), None for other jobs."""
    raw = (metadata or {}).get(TICK_KEY)
    if not isinstance(raw, str):
        return None
    try:
        return datetime.fromisoformat(raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class Periodic:
    """A periodic task: the task's ``kind`` and insert options ``opts``, its ``schedule``,
    the fixed ``args`` of its jobs, and how many missed ticks it replays (``catch_up``)."""

    kind: str
    schedule: Schedule
    opts: InsertOpts
    args: Mapping[str, Any] = field(default_factory=dict)
    catch_up: int = 0

    def __post_init__(self) -> None:
        validate_catch_up(self.catch_up)
        validate_json(dict(self.args), f"{self.kind}.args")

    def params(self, tick: datetime) -> InsertParams:
        """The job of ``tick``: scheduled for the tick, the tick in its metadata, unique by
        (kind, tick) in every state."""
        tick = _utc(tick, "tick")
        unique = UniqueOpts(by_queue=False, by_args=False, by_period=tick_id(tick), states=TICK_KEY_STATES)
        metadata = {**self.opts.metadata, TICK_KEY: tick.isoformat()}
        return InsertParams(self.kind, dict(self.args),
                            replace(self.opts, run_at=tick, unique=unique, metadata=metadata))


@dataclass(frozen=True)
class Planned:
    """One tick a planner pass dealt with: ``job_id`` of the job it enqueued, or None when
    the tick's job existed already. ``catch_up``: a missed tick replayed."""

    kind: str
    tick: datetime
    job_id: int | None
    catch_up: bool = False


@dataclass
class _Plan:
    """What the planner knows of one kind it leads: its next tick is enqueued; and the
    catch-up still to do: the ticks at or before ``walk_from`` (newest first, at most
    ``walk_left``), down to ``walk_after`` (exclusive; None: down to the first tick whose job
    exists)."""

    next: datetime
    walk_from: datetime | None = None
    walk_left: int = 0
    walk_after: datetime | None = None


class Planner:
    """Enqueues the ticks of ``tasks`` (see the module docstring) for the kinds whose lock it
    holds. :meth:`start` / :meth:`stop` run it on a thread of its own; tests drive it with
    :meth:`refresh_leadership` and :meth:`plan`."""

    def __init__(self, storage: QueueStorage, engine: Engine, tasks: Sequence[Periodic], *,
                 outages: OutageLog | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.storage = storage
        self.engine = engine
        self.tasks = {p.kind: p for p in tasks}
        self._clock = clock
        self._outages = outages if outages is not None else OutageLog(log, "qstore worker")
        self._conn: Connection | None = None
        self._held: frozenset[str] = frozenset()
        self._checked_at = -math.inf
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.RLock()  # one pass, or a release, at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- leadership ----------------------------------------------------------------------------
    def _key(self, kind: str) -> Any:
        return func.hashtextextended(literal(f"{LOCK_KEY_PREFIX}{self.storage.schema()}:{kind}"), 0)

    @property
    def leading(self) -> frozenset[str]:
        """The kinds this planner holds the lock of (as of its last check)."""
        return self._held

    def refresh_leadership(self) -> frozenset[str]:
        """Try to take the locks of the kinds not held yet, or check that the lock's session is
        alive, at most every ``LOCK_RETRY`` seconds; returns the kinds held. A dead session
        loses every kind (and raises the error)."""
        with self._lock:
            if time.monotonic() - self._checked_at < LOCK_RETRY:
                return self._held
            missing = [k for k in self.tasks if k not in self._held]
            conn = self._conn
            try:
                if conn is None:
                    conn = self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                if missing:
                    row = conn.execute(select(*[func.pg_try_advisory_lock(self._key(k)) for k in missing])).one()
                    taken = {k for k, got in zip(missing, row, strict=True) if got}
                else:
                    conn.execute(select(literal(1)))
                    taken = set()
            except BaseException:
                self._lose()
                raise
            self._checked_at = time.monotonic()
            if taken:
                self._held = self._held | taken
                log.info("qstore worker: periodic tasks planned here for schema %s: %s",
                         self.storage.schema(), ", ".join(sorted(taken)))
            if not self._held:  # no lock on this session: it goes back to the pool as it is
                self._conn = None
                conn.close()
            return self._held

    def _lose(self) -> None:
        if self._held:
            log.info("qstore worker: periodic tasks no longer planned here for schema %s: %s",
                     self.storage.schema(), ", ".join(sorted(self._held)))
        self._held = frozenset()
        self._plans.clear()
        self._checked_at = -math.inf
        self._drop_conn()

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never hand a session that may hold a lock back to the pool
            finally:
                conn.close()

    def release(self) -> None:
        """Give up every lock at once (another planner takes the kinds over)."""
        with self._lock:
            conn = self._conn
            if conn is not None and self._held:
                with contextlib.suppress(Exception):  # a dead session took its locks with it
                    conn.execute(select(func.pg_advisory_unlock_all()))
            self._lose()

    # -- planning ------------------------------------------------------------------------------
    def _enqueue(self, p: Periodic, tick: datetime) -> int | None:
        try:
            return self.storage.enqueue(self.engine, p.params(tick))
        except UniqueConflictError:
            return None

    def plan(self, now: datetime | None = None) -> list[Planned]:
        """One pass at ``now`` (default: the clock) for every kind held; returns the ticks it
        enqueued or found enqueued. A database error ends the pass (raised); what was
        enqueued before it is kept, and the next pass goes on from there."""
        with self._lock:
            at = _utc(now) if now is not None else self._clock()
            out: list[Planned] = []
            for kind in sorted(self._held):
                self._plan_kind(self.tasks[kind], at, out)
            return out

    def _plan_kind(self, p: Periodic, now: datetime, out: list[Planned]) -> None:
        plan = self._plans.get(p.kind)
        if plan is None:
            # Taking the kind over: its next tick is enqueued already unless no planner ran
            # since the last tick came; then ticks at or before now may have been missed.
            nxt = p.schedule.next_after(now)
            job_id = self._enqueue(p, nxt)
            out.append(Planned(p.kind, nxt, job_id))
            plan = self._plans[p.kind] = _Plan(nxt)
            if job_id is not None and p.catch_up:
                plan.walk_from, plan.walk_left, plan.walk_after = now, p.catch_up, None
        elif now >= plan.next:
            # The next tick has come (its job was enqueued ahead): enqueue the one after now.
            # Ticks after the old one and at or before now were missed (a late pass).
            nxt = p.schedule.next_after(now)
            out.append(Planned(p.kind, nxt, self._enqueue(p, nxt)))
            previous, plan.next = plan.next, nxt
            if p.catch_up:
                plan.walk_from, plan.walk_left, plan.walk_after = now, p.catch_up, previous
        while plan.walk_left > 0 and plan.walk_from is not None:
            tick = p.schedule.at_or_before(plan.walk_from)
            if plan.walk_after is not None and tick <= plan.walk_after:
                break  # every tick after the last one enqueued is done
            job_id = self._enqueue(p, tick)
            out.append(Planned(p.kind, tick, job_id, catch_up=True))
            if job_id is None:  # this tick's job exists: the ticks before it were not missed
                break
            log.info("qstore worker: periodic task %s: missed tick %s enqueued (catch-up)",
                     p.kind, tick.isoformat())
            plan.walk_from, plan.walk_left = tick - _MICROSECOND, plan.walk_left - 1
        else:
            return
        plan.walk_from, plan.walk_left = None, 0

    def seconds_until_due(self) -> float:
        """Seconds until the earliest next tick of the kinds held (``LOCK_RETRY`` at most)."""
        now = self._clock()
        waits = [(plan.next - now).total_seconds() for plan in self._plans.values()]
        return max(0.0, min([LOCK_RETRY, *waits]))

    # -- background thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        what = "periodic planning"
        while not self._stop.is_set():
            try:
                self.refresh_leadership()
                self.plan()
            except Exception as err:
                self._outages.failed(what, err, ERROR_RETRY)
                self._stop.wait(ERROR_RETRY)
                continue
            self._outages.ok(what)
            self._stop.wait(self.seconds_until_due() + 0.001)
        self.release()

    def start(self) -> None:
        """Start planning on a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("planner already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="qstore-periodic", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the statement in flight and release every lock."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.release()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
