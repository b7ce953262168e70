"""Helpers shared by the storage benchmarks: database setup, the xmin pin, the threaded
drain loop, the single-job enqueue loop, the paced producer with LISTEN/NOTIFY-woken
workers, latency percentiles, dead-tuple accounting and target verdicts. Nothing here knows
about a particular queue."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Connection, Engine, create_engine, make_url, text

__all__ = [
    "DrainResult",
    "PacedSchedule",
    "PickupResult",
    "ScheduleFigures",
    "Waker",
    "XminPin",
    "dead_tuples",
    "drain",
    "ensure_database",
    "ensure_pgstattuple",
    "finish",
    "format_table",
    "latency_summary",
    "make_engine",
    "median",
    "paced_pickup",
    "percentile",
    "pinned",
    "server_info",
    "timed_enqueue",
    "timed_single_enqueue",
    "verdict",
    "wal_position",
    "wal_since",
]

_SLOT_SUFFIX = re.compile(r"_\d+$")


def finish(json_path: Path | None, payload: dict[str, Any], problems: list[str]) -> int:
    """End a benchmark run: write ``payload`` as JSON when a path was given, name the
    problems that make the run invalid, and return the exit status (2 when there are any)."""
    if json_path:
        json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"\nwrote {json_path}")
    if problems:
        print("\nINVALID RUN:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    return 0


# -- setup ------------------------------------------------------------------------------
def ensure_database(url: str) -> None:
    """Create the database named by ``url`` if it does not exist (via the ``postgres``
    maintenance database; nothing else there is touched)."""
    u = make_url(url)
    name = u.database
    if not name:
        raise SystemExit("the --url must name a database")
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).scalar()
            if not exists:
                prep = conn.dialect.identifier_preparer
                conn.execute(text(f"CREATE DATABASE {prep.quote(name)}"))
    finally:
        admin.dispose()


def make_engine(url: str, threads: int, settings: dict[str, str] | None = None) -> Engine:
    """One pooled engine; every worker thread checks out its own connection. ``settings``
    become session GUCs of every connection (libpq ``options``)."""
    connect_args = {}
    if settings:
        connect_args["options"] = " ".join(
            f"-c {k.strip()}={v.strip().replace(' ', chr(92) + ' ')}" for k, v in settings.items()
        )
    return create_engine(url, pool_size=threads + 4, max_overflow=4, pool_timeout=60,
                         connect_args=connect_args)


def ensure_pgstattuple(engine: Engine) -> bool:
    """Install ``pgstattuple`` in the bench database if the server ships it."""
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        return True
    except Exception:
        return False


def server_info(engine: Engine) -> dict[str, Any]:
    names = ("server_version", "shared_buffers", "autovacuum", "synchronous_commit",
             "fsync", "max_connections", "wal_level", "checkpoint_timeout", "max_wal_size",
             "jit", "jit_above_cost")
    with engine.connect() as conn:
        settings = {
            n: conn.execute(text("SELECT current_setting(:n)"), {"n": n}).scalar_one()
            for n in names
        }
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgres": settings,
    }


def checkpoint(engine: Engine) -> None:
    """Flush dirty buffers so no phase pays for the previous phase's writes (superuser
    only; silently skipped otherwise)."""
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("CHECKPOINT"))
    except Exception:
        pass


# -- WAL ------------------------------------------------------------------------------
def wal_position(engine: Engine) -> str:
    """The server's current WAL insert position (an LSN, as text)."""
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT pg_current_wal_lsn()::text")).scalar_one())


def wal_since(engine: Engine, lsn: str) -> int:
    """Bytes of WAL the whole server wrote since ``lsn``. Unlike throughput on a shared
    2-core machine this is repeatable, so it is the figure to compare write paths by
    (anything else writing to the server in the meantime is counted too)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :lsn)"),
                                {"lsn": lsn}).scalar_one())


# -- enqueue --------------------------------------------------------------------------
def timed_enqueue(
    engine: Engine,
    fn: Callable[[Connection, Sequence[Any]], int],
    jobs: Sequence[Any],
    chunk: int,
) -> tuple[float, int]:
    """Enqueue ``jobs`` from one connection, ``chunk`` jobs per call and per transaction.
    Returns (seconds, jobs written)."""
    written = 0
    with engine.connect() as conn:
        t0 = time.perf_counter()
        for i in range(0, len(jobs), chunk):
            with conn.begin():
                written += fn(conn, jobs[i : i + chunk])
        elapsed = time.perf_counter() - t0
    return elapsed, written


# -- the xmin pin -----------------------------------------------------------------------
class XminPin:
    """A separate session that holds a transaction with an assigned xid open and idle
    (``BEGIN; SELECT txid_current();``), so VACUUM/pruning cannot remove anything deleted
    after it started."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Connection | None = None
        self.xid: int | None = None

    def __enter__(self) -> XminPin:
        self._conn = self._engine.connect()
        self._conn.begin()
        self.xid = int(self._conn.execute(text("SELECT txid_current()")).scalar_one())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.rollback()
            self._conn.close()
            self._conn = None


@contextlib.contextmanager
def pinned(engine: Engine, pin: bool) -> Iterator[XminPin | None]:
    """An :class:`XminPin` held for the block when ``pin`` is true, else nothing (``None``)."""
    if not pin:
        yield None
        return
    with XminPin(engine) as holder:
        yield holder


# -- the drain --------------------------------------------------------------------------
@dataclass
class DrainResult:
    jobs: int
    seconds: float  # start barrier -> last successful completion
    wall_seconds: float  # start barrier -> every worker exited (includes the empty re-check)
    ids: list[int] = field(repr=False)
    claim_calls: int = 0
    empty_claims: int = 0
    early_exits: int = 0
    per_thread: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # "claim: Type: message" -> count
    handled: int = 0  # calls of the job handler

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0

    @property
    def duplicates(self) -> int:
        return len(self.ids) - len(set(self.ids))


def drain(
    engine: Engine,
    *,
    threads: int,
    claim: Callable[[Connection], Sequence[Any]],
    complete: Callable[[Connection, Sequence[Any]], int],
    ids_of: Callable[[Sequence[Any]], list[int]],
    expected: int | None = None,
    recheck_pause: float = 0.01,
    idle_exit: float = 1.0,
    own_transactions: bool = False,
    handle: Callable[[Any], object] | None = None,
    tolerate_errors: bool = False,
) -> DrainResult:
    """``threads`` workers, each on its own pooled connection, loop claim + complete (one
    transaction each). A worker stops once its claims have come back empty (at least twice,
    ``recheck_pause`` apart) for ``idle_exit`` seconds, or as soon as all ``expected`` jobs
    have been completed by the pool. A worker that gave up on empties while jobs were still
    outstanding is counted in ``early_exits``.

    ``own_transactions``: instead of wrapping each call in ``BEGIN ... COMMIT`` on the
    worker's connection, pass the ``Engine`` to ``claim``/``complete`` and let each system
    run the call as its own transaction (each adapter's Engine mode).

    ``handle``: called once per claimed job, in claim order, between the claim and the
    completion of its batch (a worker's job handler; its time is part of the drain).

    ``tolerate_errors``: an exception raised by a claim or a completion is counted in
    ``DrainResult.errors`` (by call, type and message) and the worker goes on after
    ``recheck_pause``; jobs of a batch whose completion raised are not counted as drained.
    Without it the first exception stops the drain and is raised."""
    start = threading.Barrier(threads + 1)
    lock = threading.Lock()
    errors: list[BaseException] = []
    tolerated: dict[str, int] = {}

    def note(call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with lock:
            tolerated[key] = tolerated.get(key, 0) + 1
        time.sleep(recheck_pause)
    all_ids: list[int] = []
    last_done: list[float] = []
    stats = {"calls": 0, "empty": 0, "early_exits": 0, "completed": 0, "handled": 0}
    per_thread: list[int] = [0] * threads

    def worker(idx: int) -> None:
        ids: list[int] = []
        calls = empty = handled = 0
        last = 0.0
        try:
            # own_transactions: no connection per worker; each call checks one out itself
            with contextlib.nullcontext() if own_transactions else engine.connect() as conn:
                start.wait(timeout=120)
                empties = 0
                idle_since = 0.0
                while True:
                    if expected is not None and stats["completed"] >= expected:
                        break
                    try:
                        if own_transactions:
                            got = claim(engine)  # type: ignore[arg-type]
                        else:
                            assert conn is not None
                            with conn.begin():
                                got = claim(conn)
                    except Exception as exc:
                        if not tolerate_errors:
                            raise
                        calls += 1
                        note("claim", exc)
                        continue
                    calls += 1
                    if not got:
                        empty += 1
                        empties += 1
                        now = time.perf_counter()
                        if empties == 1:
                            idle_since = now
                        elif now - idle_since >= idle_exit:
                            with lock:
                                if expected is not None and stats["completed"] < expected:
                                    stats["early_exits"] += 1
                            break
                        time.sleep(recheck_pause)
                        continue
                    empties = 0
                    if handle is not None:
                        for job in got:
                            handle(job)
                            handled += 1
                    try:
                        if own_transactions:
                            done = complete(engine, got)  # type: ignore[arg-type]
                        else:
                            assert conn is not None
                            with conn.begin():
                                done = complete(conn, got)
                    except Exception as exc:
                        if not tolerate_errors:
                            raise
                        note("complete", exc)
                        continue
                    if done != len(got):
                        raise RuntimeError(
                            f"completion reported {done} of {len(got)} claimed jobs"
                        )
                    ids.extend(ids_of(got))
                    last = time.perf_counter()
                    with lock:
                        stats["completed"] += len(got)
                # Make the cumulative statistics (n_dead_tup) visible without waiting.
                with contextlib.nullcontext(conn) if conn is not None else engine.connect() as c, c.begin():
                    c.execute(text("SELECT pg_stat_force_next_flush()"))
        except threading.BrokenBarrierError:
            return
        except BaseException as exc:
            with lock:
                errors.append(exc)
            start.abort()
        finally:
            with lock:
                all_ids.extend(ids)
                stats["calls"] += calls
                stats["empty"] += empty
                stats["handled"] += handled
                per_thread[idx] = len(ids)
                if last:
                    last_done.append(last)

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(timeout=120)
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} drain worker(s) failed") from errors[0]
    seconds = (max(last_done) - t0) if last_done else wall
    return DrainResult(
        jobs=len(all_ids),
        seconds=seconds,
        wall_seconds=wall,
        ids=all_ids,
        claim_calls=stats["calls"],
        empty_claims=stats["empty"],
        early_exits=stats["early_exits"],
        per_thread=per_thread,
        errors=tolerated,
        handled=stats["handled"],
    )


# -- dead tuples ------------------------------------------------------------------------
def family_of(relname: str) -> str:
    """``ready_entries_3`` -> ``ready_entries``; ring children fold into their parent."""
    return _SLOT_SUFFIX.sub("", relname)


def dead_tuples(engine: Engine, schema: str, exact: bool,
                fold: bool = True) -> dict[str, dict[str, int]]:
    """Dead tuples per table family of ``schema`` (per table when ``fold`` is false):
    ``dead`` (``pgstattuple`` when ``exact``, else the statistics counter), ``n_dead_tup``
    (statistics), ``live`` and ``bytes`` (heap + indexes + toast)."""
    rows_sql = text(
        """
        SELECT c.relname,
               c.oid,
               coalesce(s.n_dead_tup, 0) AS n_dead_tup,
               pg_total_relation_size(c.oid) AS bytes
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
         WHERE n.nspname = :schema AND c.relkind = 'r'
         ORDER BY c.relname
        """
    )
    time.sleep(0.3)  # let the workers' forced statistics flush land
    out: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for relname, oid, n_dead, size in conn.execute(rows_sql, {"schema": schema}).all():
            dead = live = None
            if exact:
                dead, live = conn.execute(
                    text("SELECT dead_tuple_count, tuple_count FROM pgstattuple(:oid)"),
                    {"oid": oid},
                ).one()
            fam = out.setdefault(
                family_of(relname) if fold else relname,
                {"dead": 0, "n_dead_tup": 0, "live": 0, "bytes": 0,
                                     "relations": 0},
            )
            fam["dead"] += int(dead if dead is not None else n_dead)
            fam["n_dead_tup"] += int(n_dead)
            fam["live"] += int(live or 0)
            fam["bytes"] += int(size)
            fam["relations"] += 1
        conn.rollback()
    return out


# -- single-job enqueue -----------------------------------------------------------------
def timed_single_enqueue(enqueue_one: Callable[[int], object], seconds: float,
                         warmup_calls: int = 50) -> dict[str, Any]:
    """Call ``enqueue_one(i)`` (one job, its own transaction) back to back from this thread
    for ``seconds``, after ``warmup_calls`` untimed calls (numbered from -warmup_calls, so
    timed jobs are 0, 1, ...). Returns jobs, seconds, jobs/s and the per-call latency."""
    for i in range(-warmup_calls, 0):
        enqueue_one(i)
    calls: list[float] = []
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    now = t0
    while now < end:
        enqueue_one(n)
        after = time.perf_counter()
        calls.append(after - now)
        now = after
        n += 1
    elapsed = now - t0
    return {"jobs": n, "seconds": elapsed, "jobs_per_s": n / elapsed if elapsed > 0 else 0.0,
            "call_ms": latency_summary(calls)}


# -- percentiles and verdicts -------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100] of already sorted values; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Count and p50/p95/p99/max/mean of durations given in seconds, in milliseconds."""
    vals = sorted(seconds)

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return {
        "n": len(vals),
        "p50_ms": ms(percentile(vals, 50)),
        "p95_ms": ms(percentile(vals, 95)),
        "p99_ms": ms(percentile(vals, 99)),
        "max_ms": ms(vals[-1] if vals else None),
        "mean_ms": ms(sum(vals) / len(vals) if vals else None),
    }


def verdict(value: float | None, op: str, target: float, note: str | None = None) -> dict[str, Any]:
    """``{"value", "target", "result"}`` with result PASS/FAIL (``op`` is ``>=`` or ``<=``),
    or SKIP when nothing was measured; ``note`` qualifies the figure."""
    out: dict[str, Any] = {"value": value, "target": f"{op} {target}"}
    if value is None:
        out["result"] = "SKIP"
    else:
        ok = value >= target if op == ">=" else value <= target
        out["result"] = "PASS" if ok else "FAIL"
    if note:
        out["note"] = note
    return out


# -- LISTEN/NOTIFY wake-ups and the paced producer -----------------------------------------
class Waker:
    """A dedicated LISTEN session on one channel (its own psycopg connection in autocommit,
    outside the engine's pool) and a thread reading its notifications.

    Every notification is a wake-up token: it releases one thread blocked in :meth:`wait`,
    or the next thread to call it. At most ``cap`` tokens are kept (one per worker is enough:
    a woken worker claims a whole batch), so a burst does not cause a train of empty claims.
    """

    def __init__(self, engine: Engine, channel: str, cap: int) -> None:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        cparams.pop("context", None)
        self.channel = channel
        self._conn = psycopg.connect(*cargs, **cparams, autocommit=True)
        self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self._cap = max(1, cap)
        self._tokens = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.received = 0
        self._thread = threading.Thread(target=self._run, name=f"waker:{channel}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in self._conn.notifies(timeout=0.2):
                with self._cond:
                    self.received += 1
                    self._tokens = min(self._tokens + 1, self._cap)
                    self._cond.notify()

    def wait(self, timeout: float) -> bool:
        """Block until a notification's token is available (True; the token is used up) or
        ``timeout`` seconds passed (False)."""
        with self._cond:
            if self._cond.wait_for(lambda: self._tokens > 0, timeout):
                self._tokens -= 1
                return True
            return False

    def wake_all(self, n: int) -> None:
        """Release up to ``n`` waiting threads (used to stop them)."""
        with self._cond:
            self._tokens = max(self._tokens, n)
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> Waker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PickupResult:
    offered_rate: float
    window_seconds: float  # the measured part of the schedule (after the warm-up)
    enqueued: int  # jobs whose enqueue committed after the warm-up: the measured jobs
    enqueued_total: int  # including the warm-up
    producer_seconds: float  # end of the warm-up -> the last enqueue returned (>= window)
    lag_seconds: list[float] = field(repr=False)  # how late each measured enqueue started
    latencies: list[float] = field(repr=False)  # commit -> handler start, measured jobs
    enqueue_seconds: list[float] = field(repr=False)  # duration of each measured enqueue call
    claim_seconds: list[float] = field(repr=False)  # duration of each claim that got jobs
    handled: int = 0  # distinct jobs whose handler ran (warm-up included)
    duplicates: int = 0  # handler runs beyond the first for a job
    missing: int = 0  # enqueued, never handled
    completed: int = 0  # jobs the completions reported done
    claim_calls: int = 0
    empty_claims: int = 0
    wakes_notify: int = 0  # waits ended by a notification
    wakes_poll: int = 0  # waits that timed out (the polling fallback)
    poll_claims_with_jobs: int = 0  # claims after a timed-out wait that found jobs
    notifications: int = 0
    negative_latencies: int = 0  # handler started before the producer saw its commit return
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def achieved_rate(self) -> float:
        return self.enqueued / self.producer_seconds if self.producer_seconds > 0 else 0.0


@dataclass
class ScheduleFigures:
    """The measured part of a :class:`PacedSchedule`: jobs committed after the warm-up."""

    jobs: list[int]
    latencies: list[float]  # commit -> handler start, measured jobs that started
    lag_seconds: list[float]  # how late each measured enqueue call began
    enqueue_seconds: list[float]  # duration of each measured enqueue call
    producer_seconds: float  # end of the warm-up -> the last measured commit (>= the window)
    missing: int  # enqueued (warm-up included), never started


class PacedSchedule:
    """``producers`` threads sharing one schedule: job ``i`` is enqueued (``enqueue_one(i)``,
    one job, its own transaction) by the next free producer at ``t0 + i / rate``, for
    ``warmup + seconds``; they never run ahead of the schedule, catch up when late, and stop
    at the schedule's end whatever they managed. The commit time of job ``i`` is the clock
    (``time.perf_counter``) read right after ``enqueue_one`` returned."""

    def __init__(self, *, rate: float, seconds: float, warmup: float,
                 enqueue_one: Callable[[int], object], producers: int = 1,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self.rate, self.seconds, self.warmup = rate, seconds, warmup
        self._enqueue_one = enqueue_one
        self._producers = producers
        self._on_error = on_error
        self._lock = threading.Lock()
        self._next = itertools.count()
        self.commit_at: dict[int, float] = {}
        self.timing: dict[int, tuple[float, float]] = {}  # job -> (due, enqueue call began)
        self.t0 = 0.0

    def _produce(self) -> None:
        total = self.warmup + self.seconds
        end = self.t0 + total
        while True:
            with self._lock:
                i = next(self._next)
            due = self.t0 + i / self.rate
            if i / self.rate >= total or time.perf_counter() >= end:
                break
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            began = time.perf_counter()
            try:
                self._enqueue_one(i)
            except Exception as exc:
                if self._on_error is not None:
                    self._on_error(exc)
                continue
            done = time.perf_counter()
            with self._lock:
                self.commit_at[i] = done
                self.timing[i] = (due, began)

    def run(self) -> None:
        """Run the schedule to its end (blocks)."""
        self.t0 = time.perf_counter() + 0.05
        threads = [threading.Thread(target=self._produce, daemon=True) for _ in range(self._producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def settle(self, started: dict[int, float], lock: threading.Lock, timeout: float) -> bool:
        """Wait until every enqueued job is in ``started`` (guarded by ``lock``) or
        ``timeout`` seconds passed; returns whether all started."""
        until = time.perf_counter() + timeout
        while time.perf_counter() < until:
            with lock:
                if all(i in started for i in self.commit_at):
                    return True
            time.sleep(0.05)
        return False

    def measured(self, started: dict[int, float]) -> ScheduleFigures:
        """Pickup figures of the jobs that committed after the warm-up (a late producer's
        backlog included); the achieved rate is their number over ``producer_seconds``."""
        window = self.t0 + self.warmup
        jobs = [i for i, at in self.commit_at.items() if at >= window]
        last_return = max((self.commit_at[i] for i in jobs), default=window)
        return ScheduleFigures(
            jobs=jobs,
            latencies=[started[i] - self.commit_at[i] for i in jobs if i in started],
            lag_seconds=[self.timing[i][1] - self.timing[i][0] for i in jobs],
            enqueue_seconds=[self.commit_at[i] - self.timing[i][1] for i in jobs],
            producer_seconds=max(last_return - window, self.seconds),
            missing=sum(1 for i in self.commit_at if i not in started),
        )


def paced_pickup(
    *,
    rate: float,
    seconds: float,
    warmup: float,
    workers: int,
    batch: int,
    enqueue_one: Callable[[int], object],
    claim: Callable[[], Sequence[Any]],
    complete: Callable[[Sequence[Any]], int],
    seq_of: Callable[[Any], int],
    waker: Waker,
    poll_interval: float,
    producers: int = 1,
    settle_timeout: float = 30.0,
) -> PickupResult:
    """``producers`` threads share one schedule: job ``i`` is enqueued (``enqueue_one(i)``,
    one job, its own transaction) by the next free producer at ``t0 + i / rate``, for
    ``warmup + seconds``; they never run ahead of the schedule, catch up when late, and stop
    at the schedule's end whatever they managed (several producers only keep enqueues whose
    commits take longer than ``1 / rate`` on schedule). The commit time of job ``i`` is the
    clock read right after ``enqueue_one`` returned.

    ``workers`` threads each loop: ``claim()``; on jobs, record the handler start
    (``time.perf_counter``, the producer's clock) of each job (``seq_of(job)``), complete the
    batch with one ``complete`` call and claim again at once if the batch was full; on a
    short or empty batch wait on ``waker`` (a notification, or ``poll_interval`` seconds).
    Once the producers are done the workers run until every enqueued job was handled (or
    ``settle_timeout``). Pickup latency = handler start - commit, for the jobs that
    committed after the warm-up; the achieved rate is their number over the time from the
    warm-up's end to the last commit (at least ``seconds``). Errors of any call are counted (call, type, message) and the loop goes on."""
    lock = threading.Lock()
    started: dict[int, float] = {}
    errors: dict[str, int] = {}
    claim_secs: list[float] = []
    st = {"calls": 0, "empty": 0, "wn": 0, "wp": 0, "poll_hits": 0, "completed": 0, "dups": 0}
    stop = threading.Event()

    def note(call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with lock:
            errors[key] = errors.get(key, 0) + 1

    schedule = PacedSchedule(rate=rate, seconds=seconds, warmup=warmup, enqueue_one=enqueue_one,
                             producers=producers, on_error=lambda exc: note("enqueue", exc))

    def worker() -> None:
        polled = False
        while not stop.is_set():
            began = time.perf_counter()
            try:
                got = claim()
            except Exception as exc:
                note("claim", exc)
                got = []
            took = time.perf_counter() - began
            with lock:
                st["calls"] += 1
                if not got:
                    st["empty"] += 1
                elif polled:
                    st["poll_hits"] += 1
            if got:
                claim_secs.append(took)
                for job in got:  # the handler: a no-op that notes when it started
                    at = time.perf_counter()
                    seq = seq_of(job)
                    with lock:
                        if seq in started:
                            st["dups"] += 1
                        else:
                            started[seq] = at
                try:
                    done = complete(got)
                except Exception as exc:
                    note("complete", exc)
                    done = 0
                with lock:
                    st["completed"] += done
                if len(got) >= batch:
                    polled = False
                    continue
            if stop.is_set():
                break
            woke = waker.wait(poll_interval)
            polled = not woke
            with lock:
                st["wn" if woke else "wp"] += 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in pool:
        t.start()
    schedule.run()
    schedule.settle(started, lock, settle_timeout)
    stop.set()
    waker.wake_all(workers)
    for t in pool:
        t.join(timeout=30)

    m = schedule.measured(started)
    return PickupResult(
        offered_rate=rate,
        window_seconds=seconds,
        enqueued=len(m.jobs),
        enqueued_total=len(schedule.commit_at),
        producer_seconds=m.producer_seconds,
        lag_seconds=m.lag_seconds,
        latencies=m.latencies,
        enqueue_seconds=m.enqueue_seconds,
        claim_seconds=claim_secs,
        handled=len(started),
        duplicates=st["dups"],
        missing=m.missing,
        completed=st["completed"],
        claim_calls=st["calls"],
        empty_claims=st["empty"],
        wakes_notify=st["wn"],
        wakes_poll=st["wp"],
        poll_claims_with_jobs=st["poll_hits"],
        notifications=waker.received,
        negative_latencies=sum(1 for x in m.latencies if x < 0),
        errors=errors,
    )


# -- output -----------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(r, widths, strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
