"""The maintainer: a leader-elected loop that runs an install's periodic upkeep.

Queue storage needs upkeep that nothing on the enqueue/claim/complete path does: rotating
and pruning the three rings (without it history is never truncated), promoting due
scheduled and retryable jobs (without it they never become claimable), rescuing abandoned
attempts (stale heartbeats, passed deadlines, timed-out callbacks), folding terminal
count deltas into the counters and deleting released unique keys (both only while the MVCC
horizon is not pinned). :class:`Maintainer` runs those tasks on the cadences of a
:class:`MaintenanceSchedule`, in a background thread or one pass at a time.

Any number of processes may run a maintainer for the same install: each tries to take a
session advisory lock keyed on the schema name, only the holder runs tasks, and the others
retry until the holder's session ends (stop, crash, network loss), then one of them takes
over. The lock lives on a dedicated connection in autocommit mode, so leadership never
holds a transaction open (it does not pin the MVCC horizon). Every task runs on the given
``Engine`` in its own transaction; a failing task is reported, tried again after
``min(its cadence, 5 s)``, and the loop goes on. Failures are logged through an
:class:`~qstore.outage.OutageLog`: while the database is away, one WARNING line when
maintenance starts failing (and when it fails differently), DEBUG for the repeats, one INFO
line when it works again; a traceback only at DEBUG, or for an error that is not a database
error (a bug).

:meth:`Maintainer.stop` wakes the thread at once: it finishes the statement in flight (one
task, or one prune of a tick that prunes several slots) and runs nothing more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, Engine, func, literal, select
from sqlalchemy.exc import SQLAlchemyError

from qstore.errors import ValidationError
from qstore.outage import OutageLog
from qstore.storage import QueueStorage
from qstore.storage.checks import MAX_BATCH
from qstore.types import JobState, PruneKind, PruneOutcome, RotateKind, RotateOutcome

__all__ = ["Maintainer", "MaintenanceSchedule", "RingTick", "TaskReport"]

log = logging.getLogger("qstore.maintainer")

#: Prefix of the leader lock key (followed by the schema name); its version changes when
#: upkeep changes in a way a previous release's maintainer cannot follow.
LEADER_KEY_PREFIX = "qstore:maintainer:3:"

#: Rescue functions return at most this many rows per call; a full
#: batch means more may be waiting, so the task calls again (up to ``RESCUE_MAX_CALLS``).
RESCUE_BATCH = 500
RESCUE_MAX_CALLS = 32

#: A task that failed runs again after its cadence or this many seconds, whichever is
#: shorter (the rescue and rollup tasks run every 30 s by default).
TASK_RETRY_AFTER = 5.0


def _finite(value: float) -> bool:
    """True for a number that is a finite float (an int too large for a float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


#: Upper bounds of schedule fields that reach a bounded storage argument or a thread wait.
_LIMITS: dict[str, float] = {
    "heartbeat_staleness": 86400.0,  # rescue_stale_heartbeats: at most one day
    "leader_retry_every": 86400.0,  # waited on directly by the background thread
    "promote_batch_size": MAX_BATCH,  # promote_due binds it as integer
}


@dataclass(frozen=True)
class MaintenanceSchedule:
    """Cadences (seconds) and batch limits of the maintenance tasks.

    The queue ring rotates every 5 s by default: every rotation leads to one prune (gates
    that read the slot's rows, an exclusive lock on its tables and a ``TRUNCATE`` of a dozen
    relations), a burst of server work that slows the claims around it. Measured at 500 jobs/s
    through a worker, rotating every second put the pickup p95 at 9-11 ms, every 5 s at
    3-7 ms; the price is that a slot holds 5 s of jobs, so finished jobs stay readable (and
    their bytes stay on disk) for 5-10 s instead of 1-2 s.

    The claim ring turns by volume: its task runs every ``claim_ring_every`` seconds, reads
    how many bytes the current slot's receipts and closures take (one statement), and turns
    the ring (prune the oldest slot, a two-table ``TRUNCATE``, and rotate into it) only once they
    reach ``claim_ring_turn_bytes`` (512 KiB, about 1,700 claimed jobs) or the slot has been
    current for ``claim_ring_turn_after`` seconds. A slot then holds about the same bytes at
    any claim rate: at 2,000 jobs/s it turns every second, at 500 jobs/s every 3-4 s
    instead of every second, and a claim-ring turn runs under fewer of the slowest pickups.
    ``claim_ring_turn_bytes=0`` turns it on every run (a fixed clock).

    Every ``keys_every`` seconds the released unique claims are deleted, unless a snapshot
    has pinned the horizon for ``rollup_pinned_after`` seconds (then the run touches
    nothing): until then a released key is a claim row and a release row, free to take.

    Every field must be a positive finite number, except ``prune_backoff_limit`` and
    ``claim_ring_turn_bytes``, which may be 0. After ``k`` consecutive prunes of a ring that
    pruned nothing, the next ``2**min(k, prune_backoff_limit) - 1`` ticks of that ring only
    rotate. The values the tasks pass on are bounded as the storage calls require:
    ``heartbeat_staleness`` and ``leader_retry_every`` at most one day,
    ``promote_batch_size`` at most 2**31 - 1.
    """

    queue_ring_every: float = 5.0
    lease_ring_every: float = 0.25
    claim_ring_every: float = 1.0
    claim_ring_turn_bytes: int = 512 * 1024
    claim_ring_turn_after: float = 5.0
    promote_every: float = 0.25
    promote_batch_size: int = 4096
    promote_max_batches: int = 32
    wheel_every: float = 1.0
    rescue_every: float = 30.0
    heartbeat_staleness: float = 90.0
    rollup_every: float = 30.0
    rollup_max_slots: int = 4
    rollup_pinned_after: float = 5.0
    keys_every: float = 5.0
    prune_backoff_limit: int = 5
    leader_retry_every: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            floor_ok = f.name in ("prune_backoff_limit", "claim_ring_turn_bytes")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not _finite(value) or value < 0 or (value == 0 and not floor_ok)):
                raise ValidationError(f.name, value, "must be a positive finite number"
                                      if not floor_ok else "must be a non-negative integer")
            if f.name.endswith(("_size", "_batches", "_slots", "_limit", "_bytes")) and not isinstance(value, int):
                raise ValidationError(f.name, value, "must be an integer")
            limit = _LIMITS.get(f.name)
            if limit is not None and value > limit:
                raise ValidationError(f.name, value, f"must be at most {limit}")


@dataclass(frozen=True)
class TaskReport:
    """What one run of one task did: ``result`` on success, ``error`` (the exception's
    text) on failure. ``duration`` is in seconds; ``started`` is the ``time.monotonic()``
    reading when the run began (to line runs up with other events of the process)."""

    task: str
    result: Any
    error: str | None
    duration: float
    started: float = 0.0


@dataclass(frozen=True)
class RingTick:
    """One ring tick: the rotation's outcome, and the prune's (``None`` while backing off).
    ``caught_up``: further sealed slots pruned in the same tick after a first ``pruned``.
    A claim-ring tick that found the current slot not yet due to turn (below its byte
    threshold and younger than its age limit) did nothing: ``rotate`` and ``prune`` are
    ``None`` and ``slot_bytes`` holds the bytes it found."""

    rotate: RotateOutcome | None
    prune: PruneOutcome | None
    caught_up: int = 0
    slot_bytes: int | None = None

    @property
    def slots_pruned(self) -> int:
        """Slots this tick truncated."""
        return (self.prune is not None and self.prune.kind is PruneKind.PRUNED) + self.caught_up

    @property
    def rotated(self) -> bool:
        """True when this tick moved the ring to its next slot."""
        return self.rotate is not None and self.rotate.kind is RotateKind.ROTATED


@dataclass(frozen=True)
class TurnWhen:
    """When a ring whose slots should hold a bounded volume turns: once ``filled()`` (bytes
    written to the current slot) reaches ``bytes``, or ``after`` seconds after the ring last
    turned (or was found idle), whichever comes first."""

    filled: Callable[[], int]
    bytes: int
    after: float


class _Ring:
    """Prune, then rotate, every tick; the prune is left out while backing off after prunes
    that pruned nothing.

    Pruning first means a tick prunes slots that were sealed a tick ago or earlier, never the
    slot its own rotation seals: that slot still holds the jobs of the last moments (some
    not claimed or not finished yet), and the lanes' claim cursors have not yet passed its
    last rows, so its prune would often be refused, or pay for a row-by-row pending count,
    for history that goes a tick later anyway. A queue slot is therefore kept for one tick
    after it is sealed. For the lease and claim rings, which prune the slot their next
    rotation enters, pruning first lets that rotation happen in the same tick.

    A tick that prunes goes on pruning (each slot its own call) until a prune prunes
    nothing or ``most`` slots went: one prune a tick would never win back a slot that a
    skipped prune (a slot still busy, or backing off) left behind, and the ring would keep
    one more slot of history on disk for good each time. The lease and claim rings prune
    only the oldest slot of the current generation, the same slot on every call of one
    tick, so they are built with ``most=1``: a second call could only find that slot
    already truncated.

    With ``turn`` (the claim ring), a tick first asks whether the ring is due to turn and
    does nothing else when it is not. Due stays true until a rotation happens: a turn
    refused because the oldest slot is still busy (its prune skipped or blocked) is retried
    on every following tick."""

    def __init__(self, rotate: Callable[[], RotateOutcome], prune: Callable[[], PruneOutcome],
                 backoff_limit: int, most: int, turn: TurnWhen | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self._rotate, self._prune, self._limit, self._most = rotate, prune, backoff_limit, most
        self._turn = turn
        self._stopping = stopping  # a stopping maintainer prunes no further slot
        self._misses = 0
        self._skip = 0
        self._turned_at = -math.inf

    def __call__(self, force: bool = False) -> RingTick:
        """One tick; ``force`` turns the ring whatever ``turn`` says (a full pass)."""
        if self._turn is not None and not force:
            due_by_age = time.monotonic() - self._turned_at >= self._turn.after
            filled = None if due_by_age else self._turn.filled()
            if filled is not None and filled < self._turn.bytes:
                return RingTick(None, None, slot_bytes=filled)
        pruned, caught_up = self._prune_slots()
        rotated = self._rotate()
        if rotated.kind in (RotateKind.ROTATED, RotateKind.SKIPPED_IDLE):
            self._turned_at = time.monotonic()
        return RingTick(rotated, pruned, caught_up)

    def _prune_slots(self) -> tuple[PruneOutcome | None, int]:
        if self._skip > 0:
            self._skip -= 1
            return None, 0
        pruned = self._prune()
        caught_up = 0
        if pruned.kind is PruneKind.PRUNED:
            self._misses = 0
            while caught_up + 1 < self._most and not self._stopping() and self._prune().kind is PruneKind.PRUNED:
                caught_up += 1
        else:
            self._misses += 1
            self._skip = 2 ** min(self._misses, self._limit) - 1
        return pruned, caught_up


@dataclass
class _Task:
    name: str
    every: float
    run: Callable[[], Any]
    full: Callable[[], Any] | None = None  # what a full pass (run_all) runs instead
    due: float = 0.0
    reports: list[TaskReport] = field(default_factory=list)


class Maintainer:
    """Runs the upkeep of one install (``storage``) against ``engine``.

    Use :meth:`start` / :meth:`stop` (or ``with Maintainer(...):``) for a background thread,
    or drive it yourself: :meth:`acquire_leadership`, then :meth:`run_pending` on your own
    clock or :meth:`run_all` for one full pass. ``engine`` must be a synchronous
    ``Engine`` (for an async application, a second engine on the same URL); while this
    maintainer leads, it keeps one of the engine's pooled connections for the lock.
    Leadership methods may be called from any thread. Failures are logged through
    ``outages`` (a worker passes its own, so that its outage ends with one recovery line; by
    default the maintainer's own, on ``qstore.maintainer``).
    """

    def __init__(self, storage: QueueStorage, engine: Engine,
                 schedule: MaintenanceSchedule | None = None, *, keep_reports: int = 100,
                 outages: OutageLog | None = None) -> None:
        if not isinstance(storage, QueueStorage):
            raise ValidationError("storage", storage, "expected QueueStorage")
        if not isinstance(engine, Engine):
            raise ValidationError("engine", engine, "the maintainer needs a synchronous Engine")
        if schedule is not None and not isinstance(schedule, MaintenanceSchedule):
            raise ValidationError("schedule", schedule, "expected MaintenanceSchedule or None")
        if isinstance(keep_reports, bool) or not isinstance(keep_reports, int) or keep_reports < 1:
            raise ValidationError("keep_reports", keep_reports, "must be an integer of at least 1")
        self.storage = storage
        self.engine = engine
        self.schedule = schedule or MaintenanceSchedule()
        self._keep = keep_reports
        self._lock_conn: Connection | None = None
        self._leadership = threading.RLock()  # guards _lock_conn (one SQLAlchemy Connection, many threads)
        self._checked_at = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._outages = outages if outages is not None else OutageLog(log, "qstore maintainer")
        self._tasks = self._build_tasks()

    # -- tasks ------------------------------------------------------------------------
    def _build_tasks(self) -> list[_Task]:
        s, e, sch = self.storage, self.engine, self.schedule
        lim = sch.prune_backoff_limit
        by_volume = TurnWhen(lambda: s.claim_slot_bytes(e), sch.claim_ring_turn_bytes,
                             sch.claim_ring_turn_after) if sch.claim_ring_turn_bytes else None
        claim_ring = _Ring(lambda: s.rotate_claims(e), lambda: s.prune_oldest_claims(e), lim, 1, by_volume)
        return [
            _Task("queue_ring", sch.queue_ring_every,
                  _Ring(lambda: s.rotate(e), lambda: s.prune_oldest(e), lim, s.queue_slot_count(),
                        stopping=self._stop.is_set)),
            _Task("lease_ring", sch.lease_ring_every,
                  _Ring(lambda: s.rotate_leases(e), lambda: s.prune_oldest_leases(e), lim, 1)),
            _Task("claim_ring", sch.claim_ring_every, claim_ring, lambda: claim_ring(force=True)),
            _Task("promote", sch.promote_every, self._promote),
            _Task("wheel", sch.wheel_every, self._wheel),
            _Task("rescue", sch.rescue_every, self._rescue),
            _Task("rollup", sch.rollup_every,
                  lambda: s.rollup_terminal_count_deltas(
                      e, sch.rollup_max_slots,
                      pinned_after=timedelta(seconds=sch.rollup_pinned_after))),
            _Task("unique_keys", sch.keys_every,
                  lambda: {"purged": s.purge_released_keys(
                      e, pinned_after=timedelta(seconds=sch.rollup_pinned_after))}),
        ]

    def _promote(self) -> dict[str, int]:
        """Due ``scheduled`` and ``retryable`` jobs together, in ``run_at`` order across the
        two states, in bounded batches (one transaction each), until a batch comes back
        short."""
        size = self.schedule.promote_batch_size
        moved = dict.fromkeys((JobState.SCHEDULED.value, JobState.RETRYABLE.value), 0)
        for _ in range(self.schedule.promote_max_batches):
            batch = self.storage.promote_all_due(self.engine, size)
            for state, n in batch.items():
                moved[state.value] += n
            if sum(batch.values()) < size:
                break
        return moved

    def _wheel(self) -> dict[str, int]:
        """Overflow rows that came within the wheel's span move into it (bounded batches),
        then the wheel's past slots whose entries are all resolved are truncated."""
        size = self.schedule.promote_batch_size
        moved = 0
        for _ in range(self.schedule.promote_max_batches):
            n = self.storage.advance_overflow(self.engine, size)
            moved += n
            if n < size:
                break
        pruned = self.storage.prune_wheel(self.engine)
        return {"overflow_moved": moved, "slots_pruned": len(pruned.pruned),
                "slots_waiting": len(pruned.waiting), "slots_blocked": len(pruned.blocked)}

    def _rescue(self) -> dict[str, int]:
        """Stale heartbeats, passed deadlines and timed-out callbacks, until a call comes
        back short of a full batch. Returns how many attempts each family rescued."""
        s, e = self.storage, self.engine
        staleness = timedelta(seconds=self.schedule.heartbeat_staleness)
        families: dict[str, Callable[[], list[Any]]] = {
            "heartbeat": lambda: s.rescue_stale_heartbeats(e, staleness),
            "deadline": lambda: s.rescue_expired_deadlines(e),
            "callback": lambda: s.rescue_expired_callbacks(e),
        }
        rescued: dict[str, int] = {}
        for name, call in families.items():
            total = 0
            for _ in range(RESCUE_MAX_CALLS):
                n = len(call())
                total += n
                if n < RESCUE_BATCH:
                    break
            rescued[name] = total
        return rescued

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self._tasks]

    def reports(self, task: str | None = None) -> list[TaskReport]:
        """The most recent reports of one task (oldest first), or of every task (grouped
        by task, in task order)."""
        chosen = [t for t in self._tasks if task is None or t.name == task]
        if task is not None and not chosen:
            raise ValidationError("task", task, f"not one of {self.task_names}")
        return [r for t in chosen for r in t.reports]

    def _run(self, task: _Task, *, full: bool = False, retry_in: float | None = None) -> TaskReport:
        started = time.monotonic()
        try:
            result, error = (task.full if full and task.full is not None else task.run)(), None
        except Exception as exc:  # a task's failure must not stop the other tasks
            self._outages.failed("maintenance", exc, retry_in, key=task.name, detail=f"task {task.name}")
            result, error = None, f"{type(exc).__name__}: {exc}"
        else:
            self._outages.ok("maintenance", key=task.name)
        report = TaskReport(task.name, result, error, time.monotonic() - started, started)
        task.reports.append(report)
        del task.reports[:-self._keep]
        return report

    def run_all(self) -> list[TaskReport]:
        """Run every task once now, whether due or not (leadership is not checked); every
        ring turns if it can, whatever its volume."""
        now = time.monotonic()
        out = []
        for t in self._tasks:
            out.append(self._run(t, full=True))
            t.due = now + t.every
        return out

    def _retry_after(self, task: _Task) -> float:
        return min(task.every, TASK_RETRY_AFTER)

    def run_pending(self) -> list[TaskReport]:
        """Run the tasks that are due, if this maintainer holds leadership; returns their
        reports (empty when none was due or another maintainer leads)."""
        if not self.is_leader():
            return []
        out = []
        for t in self._tasks:
            if self._stop.is_set():  # stopping: the tasks still due wait for the next leader
                break
            now = time.monotonic()
            if t.due <= now:
                report = self._run(t, retry_in=self._retry_after(t))
                out.append(report)
                if report.error is not None:
                    t.due = time.monotonic() + self._retry_after(t)
                else:
                    # fixed cadence from when the task was due (from this run for a task that
                    # never ran: its due time is 0, not a point on its cadence); a task that
                    # overran its interval runs again one interval later
                    t.due = max((t.due or now) + t.every, time.monotonic())
        return out

    def seconds_until_due(self) -> float:
        return max(0.0, min(t.due for t in self._tasks) - time.monotonic())

    # -- leadership -------------------------------------------------------------------
    def _lock_key(self) -> Any:
        # Versioned by upkeep protocol: a maintainer of a release whose ring upkeep cannot run
        # against this schema (during a rolling deploy) holds another key, so it never keeps
        # a current maintainer from leading.
        return func.hashtextextended(literal(LEADER_KEY_PREFIX) + literal(self.storage.schema()), 0)

    def acquire_leadership(self) -> bool:
        """Try once to become this install's leader; True if this maintainer now leads.

        The lock is a session-level advisory lock on a dedicated autocommit connection; it
        is released by :meth:`release_leadership` or when that session ends.
        """
        with self._leadership:
            return self._acquire()

    def _acquire(self) -> bool:
        if self.is_leader():
            return True
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            got = bool(conn.execute(select(func.pg_try_advisory_lock(self._lock_key()))).scalar_one())
        except BaseException:
            conn.invalidate()  # a connection that failed is not reset back into the pool
            conn.close()
            raise
        if not got:
            conn.close()
            return False
        self._lock_conn = conn
        self._checked_at = time.monotonic()
        log.info("qstore maintainer leads schema %s", self.storage.schema())
        return True

    def is_leader(self) -> bool:
        """Whether this maintainer holds leadership. The lock's session is checked for
        liveness at most every ``leader_retry_every`` seconds; a dead session ends it."""
        with self._leadership:
            return self._check()

    def _check(self) -> bool:
        conn = self._lock_conn
        if conn is None:
            return False
        if time.monotonic() - self._checked_at < self.schedule.leader_retry_every:
            return True
        try:
            conn.execute(select(literal(1)))
        except SQLAlchemyError as exc:  # dead session, or a connection SQLAlchemy invalidated
            self._outages.failed("maintenance", exc, self.schedule.leader_retry_every, key="leadership",
                                 detail=f"leadership of schema {self.storage.schema()} lost")
            self._drop_lock_conn()
            return False
        self._checked_at = time.monotonic()
        return True

    def _drop_lock_conn(self) -> None:
        conn, self._lock_conn = self._lock_conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never return a session that may still hold the lock to the pool
            finally:
                conn.close()

    def release_leadership(self) -> None:
        """Give up leadership (another maintainer may take it over at once)."""
        with self._leadership:
            self._release()

    def _release(self) -> None:
        conn = self._lock_conn
        if conn is None:
            return
        try:
            conn.execute(select(func.pg_advisory_unlock(self._lock_key())))
        except SQLAlchemyError:
            pass  # the session is gone, and the lock with it
        finally:
            self._drop_lock_conn()

    # -- background thread ------------------------------------------------------------
    def _loop(self) -> None:
        every = self.schedule.leader_retry_every
        while not self._stop.is_set():
            try:
                leading = self.acquire_leadership()
            except Exception as exc:  # the loop outlives database outages; tasks catch their own
                self._outages.failed("maintenance", exc, every, key="leadership", detail="taking leadership")
                self._stop.wait(every)
                continue
            self._outages.ok("maintenance", key="leadership")
            if not leading:
                self._stop.wait(every)
                continue
            try:
                self.run_pending()
            except Exception as exc:
                self._outages.failed("maintenance", exc, every, key="leadership", detail="leadership check")
                self._stop.wait(every)
                continue
            self._stop.wait(min(self.seconds_until_due(), every))
        self.release_leadership()

    def start(self) -> None:
        """Start the background thread (a daemon); it competes for leadership and, while it
        leads, runs every task when due."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("maintainer already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"qstore-maintainer-{self.storage.schema()}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread after its current task and release leadership."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.release_leadership()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Maintainer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
