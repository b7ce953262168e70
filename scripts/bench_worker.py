"""The worker benchmark: qstore's :class:`qstore.worker.Worker` with its default settings,
side by side in one run with the same storage driven by a plain loop and with two classic
SKIP LOCKED queues: the in-repo SQLAlchemy one (``classic_queue.py``) and one written
directly on psycopg 3 (``classic_psycopg.py``: prepared statements, a connection per worker
thread). Every ratio is computed against the better of the two classic queues in the same
run (the faster drain, the lower pickup p95, the faster single enqueue), and both are
reported.

Modes (``--mode``, default all three):

``drain`` — per round, phase (``clean``, then ``pinned``: another session holds an xid
from before the drain until the dead tuples are counted) and system, N no-op jobs
(``--jobs``, default 20,000) are loaded with COPY into a fresh schema, then drained with
``--concurrency`` (16) concurrent handlers. The rows of one COPY share one of a queue's
lanes, so the worker's backlog lies in one lane unless ``--load-lanes N`` loads it in N
COPYs (N lanes, at most the queue's eight; each result names its ``lanes``):

* ``classic`` — 16 threads loop claim 10 / no-op handler per job / ``DELETE`` the batch
  over SQLAlchemy (each call one autocommitted statement): the natural loop of
  ``bench_storage.py``;
* ``classic_pg`` — the same loop on psycopg 3 directly: 16 worker threads, each on its own
  connection, prepared ``UPDATE … RETURNING`` claim of 10 and ``DELETE``
  (``--classic-pg-driver asyncio``: coroutines instead);
* ``storage`` — the same loop over qstore's storage API with an Engine target
  (``claim_runtime_batch(engine, queue, 10)`` / handler / ``complete_runtime_batch``): the
  storage-level rate the worker is held to;
* ``worker`` — a :class:`~qstore.tasks.App` with one no-op task and a
  :class:`~qstore.worker.Worker` (``concurrency=16``, every other setting its default, the
  maintainer running inside as by default); the drain runs from ``worker.start()`` until
  the worker has committed every completion.

With ``--claims-in-flight 1,2`` (a comma-separated list) the drain and the pickup run the
worker once per value, one after the other in each round and phase (the order turned round
every other round, so the values alternate): the first value is the run's ``worker`` (its
targets and ratios), each further value N runs as ``worker_cN`` (and ``async_worker_cN``),
and the summaries add its ratio to the ``worker`` of the same run; without it the worker
runs with the setting's default. The pickup's table then shows the worker's claim and
completion calls per job.

With ``--async`` the drain and the pickup also run ``async_worker``: an
:class:`~qstore.worker.AsyncWorker` (the same settings, on an event loop of its own thread,
over an ``AsyncEngine`` on the same URL) with an ``async def`` no-op task, right after the
thread worker in each round and phase; the summaries then add the async worker against the
thread worker of the same run.

Per drain: jobs/s, and per job the WAL the server wrote, the time the database's sessions
spent running statements (``pg_stat_database.active_time``), the CPU of the database's
backend processes (from ``/proc``, the server being on this host), the server transactions
and the benchmark process's own CPU (``time.process_time``: the client's CPU, the
measuring thread's taken out). For the worker and the psycopg classic queue also when the
first handler started after the drain's clock did (the start-up: the worker opens its
connections within its clock, the classic queue opened and prepared its own before) and
the rate between the 10th and the 90th percentile handler start (``steady``: the drain
once under way). With ``--account-jobs N`` (default 5,000; 0 skips it) each
system then drains N more jobs once in a clean phase with every connection's protocol
traced (libpq trace, which costs client time, so nothing of this run is timed): round
trips and protocol messages per job, and where the WAL went per relation
(``pg_walinspect``).

``pickup`` — per offered rate (``--rates``, default 500 and 2,000 jobs/s), phase and
system, ``--producers`` threads share a schedule of single enqueues for ``--duration``
seconds (after ``--warmup`` seconds that are not measured) while the system's workers run
(16 of them): qstore's default worker (producers call ``task.defer(engine, ...)``), the
SQLAlchemy classic queue (an autocommitted ``INSERT`` whose statement trigger sends
``NOTIFY``; 16 threads woken by ``LISTEN``, claim 10) and the psycopg classic queue (a
prepared ``INSERT`` that sends its own ``pg_notify``; 16 worker threads woken by
``LISTEN``, claim 10). Pickup latency = handler start - the clock read right after the
enqueue call returned (one process, one clock). For the worker it also lines the
maintainer's runs up with the pickups (``tail_overlap``).

``enqueue`` — per phase, one thread enqueues single jobs back to back for
``--enqueue-seconds``: qstore ``task.defer(engine, ...)`` (one autocommitted statement),
the SQLAlchemy classic ``INSERT`` (with its NOTIFY trigger) and the psycopg classic's
prepared ``INSERT`` with ``pg_notify`` (autocommit).

Targets (worker with its defaults against the better classic queue of the same run,
medians over ``--rounds``): drain of 20,000 >= 1.0x clean and >= 2.0x pinned (>= 4.0x
pinned from 100,000 jobs); WAL per drained job <= the classic's; worker CPU per job
<= 30 us; >= 8,000 jobs/s in both phases and >= 0.8x the storage loop; pickup p95 <= the
classic's at every offered rate, clean and pinned (and <= 5 ms clean, <= 10 ms pinned at
500/s), with the producer holding the offered rate; single defer >= 0.8x the classic's
single enqueue.

    python scripts/bench_worker.py --rounds 3 --json worker.json
    python scripts/bench_worker.py --mode drain --jobs 100000 --phases pinned
    python scripts/bench_worker.py --mode pickup --rates 500,2000 --duration 60
    python scripts/bench_worker.py --mode drain --async --phases clean --classics psycopg
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import inspect
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_storage as bs
from _benchlib import (
    WAIT_STATES,
    PacedSchedule,
    ServerMeter,
    Waker,
    WireTrace,
    checkpoint,
    dead_tuples,
    ensure_database,
    ensure_pgstattuple,
    finish,
    format_table,
    latency_summary,
    make_engine,
    median,
    paced_pickup,
    per_job,
    pinned,
    server_info,
    thread_cpu_ns,
    timed_single_enqueue,
    verdict,
)
from classic_psycopg import ClassicPsycopg, Row

from qstore import CompletedAndClaimed
from qstore.runtime.maintainer import MaintenanceSchedule
from qstore.tasks import App, JobContext
from qstore.worker import AsyncWorker, Worker, WorkerSettings

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_worker"
PHASES = ("clean", "pinned")
MODES = ("drain", "pickup", "enqueue")
CLASSICS = {"sqlalchemy": "classic", "psycopg": "classic_pg"}  # --classics name -> system name
CLASSIC_BATCH = 10  # the classic loops claim 10, as a first worker loop does
LONG_DRAIN = 100_000  # jobs: from here on the long pinned-drain target applies
TARGETS = {
    "clean_vs_classic": 1.0,  # worker / better classic, >=
    "pinned_vs_classic": 2.0,  # worker / better classic, >=
    "pinned_vs_classic_100k": 4.0,  # worker / better classic, >=, from 100,000 jobs
    "wal_vs_classic": 1.0,  # worker WAL per job / the better classic's, <=
    "worker_cpu_us_per_job": 30.0,  # <=
    "jobs_per_s": 8_000.0,  # worker, >=, both phases
    "vs_storage": 0.8,  # worker / storage-level loop, >=
    "pickup_p95_vs_classic": 1.0,  # worker p95 / the lower classic p95, <=
    "clean_pickup_p95_ms": 5.0,  # worker, <=, at 500/s
    "pinned_pickup_p95_ms": 10.0,  # worker, <=, at 500/s
    "defer_vs_classic": 0.8,  # single defer / the faster classic single enqueue, >=
}
HOLDS_RATE = 0.99


class Recorder:
    """What the no-op task notes: when each job's handler started (by its ``n``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[int, float] = {}
        self.duplicates = 0
        self.all_started = threading.Event()
        self.expected: int | None = None

    def reset(self, expected: int | None) -> None:
        with self.lock:
            self.started = {}
            self.duplicates = 0
            self.expected = expected
            self.all_started.clear()

    def note(self, n: int) -> None:
        at = time.perf_counter()
        with self.lock:
            if n in self.started:
                self.duplicates += 1
                return
            self.started[n] = at
            if self.expected is not None and len(self.started) >= self.expected:
                self.all_started.set()


def make_app(system: bs.QstoreSystem, recorder: Recorder, *, is_async: bool = False) -> tuple[App, Any]:
    """The app under test: one no-op task of the workload's kind and queue (``async def``
    when ``is_async``)."""
    app = App(system.storage)

    if is_async:
        @app.task(kind=bs.KIND, queue=bs.QUEUE, priority=bs.PRIORITY)
        async def bench_job_async(ctx: JobContext, n: int, payload: str = "") -> None:
            recorder.note(n)

        return app, bench_job_async

    @app.task(kind=bs.KIND, queue=bs.QUEUE, priority=bs.PRIORITY)
    def bench_job(ctx: JobContext, n: int, payload: str = "") -> None:
        recorder.note(n)

    return app, bench_job


class LoopWorker:
    """An :class:`AsyncWorker` on an event loop of its own thread, with the thread worker's
    ``start`` / ``stop`` / ``stats`` / ``maintainer`` face, so the same measurements drive
    it. Its ``AsyncEngine`` is on ``url`` (the psycopg driver's async side); the maintainer
    and the handlers' contexts use ``engine``."""

    def __init__(self, app: App, url: str, engine: Engine, settings: WorkerSettings) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-async-worker", daemon=True)
        self._thread.start()
        size = settings.concurrency + 4
        self.async_engine = create_async_engine(url, pool_size=size, max_overflow=size)
        self.worker = AsyncWorker(app, self.async_engine, settings, sync_engine=engine)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def stats(self) -> Any:
        return self.worker.stats

    @property
    def maintainer(self) -> Any:
        return self.worker.maintainer

    def start(self) -> None:
        self._call(self.worker.start())

    def stop(self, timeout: float) -> Any:
        try:
            return self._call(self.worker.stop(timeout))
        finally:
            self._call(self.async_engine.dispose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


def wait_completed(worker: Any, n: int, timeout: float) -> float:
    """Poll the worker's counters until ``n`` completions were committed; returns when."""
    until = time.perf_counter() + timeout
    while time.perf_counter() < until:
        if worker.stats.completed >= n:
            return time.perf_counter()
        time.sleep(0.002)
    raise RuntimeError(f"the worker committed {worker.stats.completed} of {n} completions "
                       f"within {timeout:.0f} s")


def new_worker(app: App, engine: Engine, args: argparse.Namespace, *, is_async: bool = False,
               cycles: int | None = None) -> Any:
    """The default worker of the run: a :class:`Worker`, or a :class:`LoopWorker`; with
    ``cycles``, that many claims in flight per queue (``claims_in_flight``)."""
    extra: dict[str, Any] = {} if cycles is None else {"claims_in_flight": cycles}
    if args.shared_pool:
        extra["own_pool"] = False
    if args.prefetch is not None:
        extra["prefetch"] = args.prefetch
    if args.claim_ahead is not None:
        extra["claim_ahead"] = args.claim_ahead
    if args.claim_batch is not None:
        extra["claim_batch"] = args.claim_batch
    settings = WorkerSettings(queues=[bs.QUEUE], concurrency=args.concurrency, schedule=args.schedule, **extra)
    if is_async:
        return LoopWorker(app, args.url, engine, settings)
    return Worker(app, engine, settings)


# -- drain ------------------------------------------------------------------------------------
class Systems:
    """The systems of one run (qstore's schema and the classic queues' schemas)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.qsys = bs.QstoreSystem(args.qstore_schema, None, deadline=None)
        self.csys = bs.ClassicSystem(args.classic_schema)
        self.cpg = ClassicPsycopg(args.url, args.classic_pg_schema, driver=args.classic_pg_driver)
        self.classics = [CLASSICS[c] for c in args.classics]

    def drop(self, engine: Engine) -> None:
        self.qsys.drop(engine)
        self.csys.drop(engine)
        self.cpg.drop()


def worker_name(is_async: bool, cycles: int | None, args: argparse.Namespace) -> str:
    """The system name of a worker run: ``worker`` / ``async_worker`` for the first value
    of ``--claims-in-flight`` (or none), with ``_cN`` for the others."""
    base = "async_worker" if is_async else "worker"
    first = args.claims_in_flight[0] if args.claims_in_flight else None
    return base if cycles == first else f"{base}_c{cycles}"


def worker_variants(args: argparse.Namespace, rnd: int) -> list[int | None]:
    """The ``claims_in_flight`` values of round ``rnd``: the list, turned round in even
    rounds so that each value runs first as often as the others."""
    values: list[int | None] = list(args.claims_in_flight) or [None]
    return values if rnd % 2 else values[::-1]


def pace(starts: Iterable[float], t0: float) -> dict[str, float | None]:
    """Where a drain's time went, from the clock readings at which its handlers started:
    ``first_job_ms``, the first handler's start after the drain's clock started (the
    start-up: a worker opens its connections and makes its first claims, the classic queue
    had opened and prepared its own before its clock started), and ``steady_jobs_per_s``,
    the rate between the starts of the 10th and the 90th percentile job (neither the
    start-up nor the last completions' commits)."""
    at = sorted(starts)
    if len(at) < 10:
        return {"first_job_ms": None, "steady_jobs_per_s": None}
    lo, hi = at[len(at) // 10], at[(len(at) * 9) // 10]
    return {"first_job_ms": (at[0] - t0) * 1000.0,
            "steady_jobs_per_s": ((len(at) * 9) // 10 - len(at) // 10) / (hi - lo) if hi > lo else None}


def worker_drain(engine: Engine, system: bs.QstoreSystem, phase: str, n: int,
                 args: argparse.Namespace, exact: bool, trace: WireTrace | None = None,
                 *, is_async: bool = False, cycles: int | None = None) -> dict[str, Any]:
    """Load ``n`` jobs, then drain them with a default worker (see the module docstring)."""
    recorder = Recorder()
    app, _ = make_app(system, recorder, is_async=is_async)
    system.fresh(engine)
    checkpoint(engine)
    prepared = system.convert(bs.workload(n))
    step = -(-n // max(1, args.load_lanes))  # the rows of one COPY share one lane
    with engine.begin() as conn:
        for i in range(0, n, step):
            system.enqueue_copy(conn, prepared[i:i + step])
        lanes = conn.execute(text(f'SELECT count(DISTINCT (queue, priority, enqueue_shard)) '
                                  f'FROM "{system.schema}".ready_entries')).scalar_one()
    recorder.reset(n)
    res: dict[str, Any] = {"system": worker_name(is_async, cycles, args), "phase": phase, "jobs": n,
                           "claims_in_flight": cycles, "lanes": lanes}
    if trace is not None:
        trace.attach_engine(engine)  # the worker's connections are all new: the pool was disposed
        engine.dispose()
    with pinned(engine, phase == "pinned"):
        worker = new_worker(app, engine, args, is_async=is_async, cycles=cycles)
        meter = ServerMeter(engine, breakdown=trace is not None, waits=args.wait_states).start()
        cpu0 = time.process_time()
        threads0 = thread_cpu_ns()
        t0 = time.perf_counter()
        worker.start()
        try:
            if not recorder.all_started.wait(args.timeout):
                raise RuntimeError(f"worker started {len(recorder.started)} of {n} jobs")
            t1 = wait_completed(worker, n, args.timeout)
            cpu = time.process_time() - cpu0
            res["client_cpu_by_thread"] = cpu_by_thread(threads0, thread_cpu_ns(), n)
            if trace is not None:
                res["wire"] = trace.counts()
            use = meter.stop(engine)
        finally:
            worker.stop(timeout=30.0)
        counts = system.storage.queue_counts(engine, bs.QUEUE)
        dead = dead_tuples(engine, system.schema, exact)
    seconds = t1 - t0
    problems = []
    if len(recorder.started) != n:
        problems.append(f"handled {len(recorder.started)} of {n} jobs")
    if recorder.duplicates:
        problems.append(f"{recorder.duplicates} jobs handled twice")
    if counts.available or counts.running:
        problems.append(f"left available={counts.available} running={counts.running}")
    figures = per_job(use, n, cpu - use["sampler_cpu_s"])
    res["drain"] = {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds,
                    "cpu_us_per_job": figures["client_cpu_us_per_job"], **figures,
                    **pace(recorder.started.values(), t0)}
    res["server"] = use
    res["stats"] = stats_of(worker)
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


def thread_group(name: str) -> str:
    """The part of a thread's name that its siblings share (``qstore-handler-3``,
    ``qstore-claim-jobs#1`` and ``qstore-outcome_0`` count as ``qstore-handler``,
    ``qstore-claim-jobs`` and ``qstore-outcome``)."""
    return re.sub(r"(#\d+)?([-_]\d+)?$", "", name.split(" (")[0]) or name


def cpu_by_thread(before: dict[int, int], after: dict[int, int], jobs: int) -> dict[str, float]:
    """The CPU each group of threads (:func:`thread_group`) ran between ``before`` and
    ``after``, in µs per job; threads that ended in between are not counted. Thread names
    are read now, so call it while the worker's threads still run."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for tid, ns in after.items():
        group = thread_group(names.get(tid, "other"))
        out[group] = out.get(group, 0.0) + (ns - before.get(tid, 0)) / 1e3 / max(jobs, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def stats_of(worker: Any) -> dict[str, Any]:
    stats = getattr(worker, "stats", None)
    if stats is None:
        return {}
    if hasattr(stats, "as_dict"):
        return dict(stats.as_dict())
    if hasattr(stats, "__dataclass_fields__"):
        return {k: getattr(stats, k) for k in stats.__dataclass_fields__}
    return {"repr": repr(stats)}


def attach_pool(trace: WireTrace, engine: Engine) -> None:
    """Trace the idle pooled connections of ``engine`` (all checked out at once, so each is
    a different one) and every connection it opens from now on."""
    pool: Any = engine.pool
    conns = [engine.connect() for _ in range(pool.checkedin())]
    try:
        for c in conns:
            trace.attach(c.connection.driver_connection.pgconn)  # type: ignore[union-attr]
    finally:
        for c in conns:
            c.close()
    trace.attach_engine(engine)


def loop_drain(engine: Engine, system: Any, phase: str, n: int, args: argparse.Namespace,
               exact: bool, trace: WireTrace | None = None) -> dict[str, Any]:
    """The natural loop of ``bench_storage.py`` (16 threads, claim 10, handler, complete)."""
    nat = bs.parse_args(["--mode", "natural", "--jobs", str(n), "--threads", str(args.concurrency)])
    nat.batch = CLASSIC_BATCH
    name = "storage" if isinstance(system, bs.QstoreSystem) else "classic"
    res: dict[str, Any] = {"system": name, "phase": phase, "jobs": n}
    system.fresh(engine)
    checkpoint(engine)
    bs.load_for_drain(engine, system, system.convert(bs.workload(n)), nat, fresh=False)
    if trace is not None:
        attach_pool(trace, engine)
    def counted() -> None:
        if trace is not None:
            res["wire"] = trace.counts()

    res.update(bs.measured_drain(engine, system, phase, n, nat, exact, own_transactions=True,
                                 handle=bs.handler, tolerate_errors=True, after_drain=counted,
                                 wal_detail=trace is not None))
    return res


def pg_drain(engine: Engine, cpg: ClassicPsycopg, phase: str, n: int, args: argparse.Namespace,
             exact: bool, trace: WireTrace | None = None) -> dict[str, Any]:
    """The psycopg classic queue's drain: its workers (``--concurrency``) loop claim 10 /
    handler / ``DELETE``. Loaded with COPY and vacuumed (as the SQLAlchemy classic's table
    is after its warm-up); each worker's connection prepares its statements before the
    clock starts."""
    res: dict[str, Any] = {"system": "classic_pg", "phase": phase, "jobs": n, "driver": cpg.driver}
    cpg.create()
    checkpoint(engine)
    cpg.enqueue_copy(bs.workload(n))
    cpg.vacuum()
    meter = ServerMeter(engine, breakdown=trace is not None, waits=args.wait_states)
    clock: dict[str, float] = {}

    handled: list[float] = []  # each handler's start (list.append: one step under the GIL)

    def handle(row: Row) -> None:
        handled.append(time.perf_counter())
        bs.handler(row)

    def started() -> None:
        meter.start()
        clock["cpu"] = time.process_time()
        clock["t0"] = time.perf_counter()

    with pinned(engine, phase == "pinned") as pin:
        if pin is not None:
            res["pinned_xid"] = pin.xid
        d = cpg.drain(bs.QUEUE, n, workers=args.concurrency, batch=CLASSIC_BATCH, handle=handle,
                      on_start=started, on_end=meter.sample,
                      on_connect=None if trace is None else lambda c: trace.attach(c.pgconn),
                      on_close=None if trace is None else lambda c: trace.detach(c.pgconn))
        cpu = time.process_time() - clock["cpu"]
        if trace is not None:
            res["wire"] = trace.counts()
        use = meter.stop(engine)
        leftover = cpg.claimable(bs.QUEUE)
        dead = dead_tuples(engine, cpg.schema, exact)
    problems = []
    if d.jobs != n:
        problems.append(f"drained {d.jobs} of {n} jobs")
    if leftover:
        problems.append(f"{leftover} jobs still claimable after the drain")
    if d.duplicates:
        problems.append(f"{d.duplicates} duplicate job ids claimed")
    res["drain"] = {"jobs": d.jobs, "seconds": d.seconds, "wall_seconds": d.wall_seconds,
                    "jobs_per_s": d.jobs_per_s, "duplicates": d.duplicates,
                    "claim_calls": d.claim_calls, "empty_claims": d.empty_claims,
                    "handled": d.handled, "errors": d.errors,
                    **per_job(use, d.jobs, cpu - use["sampler_cpu_s"]), **pace(handled, clock["t0"])}
    res["server"] = use
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


def drain_plan(engine: Engine, sy: Systems, args: argparse.Namespace, exact: bool, rnd: int = 1
               ) -> list[tuple[str, Callable[[str, int, WireTrace | None], dict[str, Any]]]]:
    """(system, run(phase, jobs, trace)) in the order they run in round ``rnd`` of each phase."""
    plan: list[tuple[str, Callable[[str, int, WireTrace | None], dict[str, Any]]]] = []
    if "classic" in sy.classics:
        plan.append(("classic", lambda p, n, t: loop_drain(engine, sy.csys, p, n, args, exact, t)))
    if "classic_pg" in sy.classics:
        plan.append(("classic_pg", lambda p, n, t: pg_drain(engine, sy.cpg, p, n, args, exact, t)))
    if not args.skip_storage:
        plan.append(("storage", lambda p, n, t: loop_drain(engine, sy.qsys, p, n, args, exact, t)))
    for c in worker_variants(args, rnd):
        plan.append((worker_name(False, c, args),
                     functools.partial(worker_run, engine, sy.qsys, args, exact, False, c)))
    if args.run_async:
        for c in worker_variants(args, rnd):
            plan.append((worker_name(True, c, args),
                         functools.partial(worker_run, engine, sy.qsys, args, exact, True, c)))
    return plan


def worker_run(engine: Engine, qsys: bs.QstoreSystem, args: argparse.Namespace, exact: bool, is_async: bool,
               cycles: int | None, phase: str, n: int, trace: WireTrace | None) -> dict[str, Any]:
    return worker_drain(engine, qsys, phase, n, args, exact, trace, is_async=is_async, cycles=cycles)


def run_drain(engine: Engine, args: argparse.Namespace, exact: bool) -> list[dict[str, Any]]:
    sy = Systems(args)
    results = []
    try:
        for rnd in range(1, args.rounds + 1):
            plan = drain_plan(engine, sy, args, exact, rnd)
            for phase in args.phases:
                for label, fn in plan:
                    print(f"... drain round {rnd}/{args.rounds}: {label} / {phase}", flush=True)
                    r = fn(phase, args.jobs, None)
                    r["round"] = rnd
                    results.append(r)
                    d = r["drain"]
                    print(f"    {d['jobs_per_s']:,.0f} jobs/s, WAL {bs.fmt(d['wal_db_bytes_per_job'])} B/job, "
                          f"client CPU {d['client_cpu_us_per_job']:.0f} us/job", flush=True)
    finally:
        sy.drop(engine)
    return results


def run_accounting(engine: Engine, args: argparse.Namespace, exact: bool) -> list[dict[str, Any]]:
    """Each system drains ``--account-jobs`` jobs once, clean, with every connection traced
    (on an engine of its own, so no other run is traced): round trips and messages per job,
    and the WAL per relation."""
    sy = Systems(args)
    out = []
    try:
        for label, _ in drain_plan(engine, sy, args, exact):
            if label.startswith("async_worker"):  # its AsyncEngine's connections are not traced
                continue
            print(f"... accounting: {label}", flush=True)
            eng = make_engine(args.url, args.concurrency + args.producers + 4)
            try:
                run = dict(drain_plan(eng, sy, args, exact))[label]
                r = run("clean", args.account_jobs, WireTrace())
                r["wal_by_relation"] = r["server"].pop("wal_by_relation", None)
            finally:
                eng.dispose()
            n = max(r["drain"]["jobs"], 1)
            wire = r.get("wire", {})
            r["round_trips_per_job"] = WireTrace.round_trips(wire) / n
            r["messages_per_job"] = {k: v / n for k, v in sorted(wire.items())}
            out.append(r)
    finally:
        sy.drop(engine)
    return out


def paired(results: list[dict[str, Any]], system: str, phase: str) -> dict[str, Any]:
    """``system`` (a ``worker_cN`` or ``async_worker_cN``) against the ``worker`` (or
    ``async_worker``) of the same round and phase: each round's ratio of drain rates, and
    their median."""
    base = "async_worker" if system.startswith("async_") else "worker"
    by_round: dict[int, dict[str, float]] = {}
    for r in results:
        if r["phase"] == phase and r["system"] in (system, base):
            by_round.setdefault(r["round"], {})[r["system"]] = r["drain"]["jobs_per_s"]
    each = [rr[system] / rr[base] for rr in by_round.values() if system in rr and base in rr and rr[base]]
    return {"median": median(each) if each else None, "each": [round(x, 3) for x in each]}


def summarise_drain(results: list[dict[str, Any]], jobs: int, classics: list[str]) -> dict[str, Any]:
    med: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        med.setdefault(f"{r['system']}/{r['phase']}", []).append(r)
    out: dict[str, Any] = {}
    keys = ("wal_bytes_per_job", "wal_db_bytes_per_job", "server_active_us_per_job",
            "server_cpu_us_per_job", "server_xacts_per_job", "client_cpu_us_per_job",
            "first_job_ms", "steady_jobs_per_s")
    for key, rs in med.items():
        out[key] = {
            "rounds": len(rs),
            "jobs_per_s": median([x["drain"]["jobs_per_s"] for x in rs]),
            "jobs_per_s_all": [round(x["drain"]["jobs_per_s"]) for x in rs],
            "dead_total": median([x["dead_total"] for x in rs]),
            **{k: median([x["drain"][k] for x in rs if x["drain"].get(k) is not None]) for k in keys},
        }

    def get(system: str, phase: str, key: str = "jobs_per_s") -> float | None:
        m = out.get(f"{system}/{phase}")
        return None if m is None else m[key]

    def better(phase: str) -> str | None:
        rated = [(get(c, phase) or 0.0, c) for c in classics if get(c, phase) is not None]
        return max(rated)[1] if rated else None

    # the database's own WAL when pg_walinspect can tell it apart from other databases'
    wal_key = ("wal_db_bytes_per_job" if all(m["wal_db_bytes_per_job"] is not None for m in out.values())
               else "wal_bytes_per_job")
    ratios: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        best = better(phase)
        ratios[phase] = {
            "better_classic": best,
            "vs_classic": bs.ratio(get("worker", phase), get(best, phase) if best else None),
            "steady_vs_classic": bs.ratio(get("worker", phase, "steady_jobs_per_s"),
                                          get(best, phase, "steady_jobs_per_s") if best else None),
            "vs_each": {c: bs.ratio(get("worker", phase), get(c, phase)) for c in classics},
            "vs_storage": bs.ratio(get("worker", phase), get("storage", phase)),
            "wal_vs_classic": bs.ratio(get("worker", phase, wal_key),
                                       get(best, phase, wal_key) if best else None),
            "async_vs_worker": bs.ratio(get("async_worker", phase), get("worker", phase)),
            "cycles_vs_worker": {k.split("/")[0]: paired(results, k.split("/")[0], phase)
                                 for k in out if k.endswith(f"/{phase}") and "worker_c" in k},
        }
    t = TARGETS
    long_drain = jobs >= LONG_DRAIN
    scale = None if jobs in (20_000, LONG_DRAIN) else f"measured over {jobs:,} jobs"
    cpu = median([v for p in PHASES if (v := get("worker", p, "client_cpu_us_per_job")) is not None])
    targets = {
        "clean_vs_classic": verdict(None if long_drain else ratios["clean"]["vs_classic"], ">=",
                                    t["clean_vs_classic"], scale),
        "pinned_vs_classic": verdict(None if long_drain else ratios["pinned"]["vs_classic"], ">=",
                                     t["pinned_vs_classic"], scale),
        "pinned_vs_classic_100k": verdict(ratios["pinned"]["vs_classic"] if long_drain else None, ">=",
                                          t["pinned_vs_classic_100k"], scale),
        "clean_wal_vs_classic": verdict(ratios["clean"]["wal_vs_classic"], "<=", t["wal_vs_classic"]),
        "worker_cpu_us_per_job": verdict(cpu, "<=", t["worker_cpu_us_per_job"]),
        "clean_jobs_per_s": verdict(get("worker", "clean"), ">=", t["jobs_per_s"]),
        "pinned_jobs_per_s": verdict(get("worker", "pinned"), ">=", t["jobs_per_s"]),
        "clean_vs_storage": verdict(ratios["clean"]["vs_storage"], ">=", t["vs_storage"]),
        "pinned_vs_storage": verdict(ratios["pinned"]["vs_storage"], ">=", t["vs_storage"]),
    }
    return {"medians": out, "ratios": ratios, "targets": targets}


def print_drain(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = [[r["system"], r["phase"], r["round"], bs.fmt(r["drain"]["jobs_per_s"]),
             f"{r['drain']['seconds']:.2f}", bs.fmt(r["drain"].get("wal_bytes_per_job")),
             bs.fmt(r["drain"].get("wal_db_bytes_per_job")),
             bs.fmt(r["drain"].get("server_active_us_per_job"), ".0f"),
             bs.fmt(r["drain"].get("server_cpu_us_per_job"), ".0f"),
             bs.fmt(r["drain"].get("client_cpu_us_per_job"), ".0f"),
             bs.fmt(r["drain"].get("server_xacts_per_job"), ".2f"),
             bs.fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok"] for r in results]
    print()
    print(format_table(["system", "phase", "round", "drain j/s", "seconds", "WAL B/job",
                        "its DB's WAL B/job", "server active µs/job", "server CPU µs/job", "client CPU µs/job",
                        "server xacts/job", "dead tuples", "check"], rows))
    print("\nMedians over the rounds:")
    print(format_table(
        ["system/phase", "rounds", "drain j/s", "first job ms", "steady j/s", "WAL B/job",
         "its DB's WAL B/job", "active µs/job", "server CPU µs/job", "client CPU µs/job", "per round"],
        [[k, m["rounds"], bs.fmt(m["jobs_per_s"]), bs.fmt(m["first_job_ms"], ".1f"),
          bs.fmt(m["steady_jobs_per_s"]), bs.fmt(m["wal_bytes_per_job"]),
          bs.fmt(m["wal_db_bytes_per_job"]),
          bs.fmt(m["server_active_us_per_job"]), bs.fmt(m["server_cpu_us_per_job"]),
          bs.fmt(m["client_cpu_us_per_job"]), " ".join(f"{x:,}" for x in m["jobs_per_s_all"])]
         for k, m in summary["medians"].items()]))
    print("\nRatios (worker / the better classic queue of the phase; each classic; storage loop):")
    for phase, rr in summary["ratios"].items():
        each = "   ".join(f"vs {k} {bs.times(v)}" for k, v in rr["vs_each"].items())
        print(f"  {phase:<6}  vs classic ({rr['better_classic']}) {bs.times(rr['vs_classic'])}   "
              f"{each}   vs storage {bs.times(rr['vs_storage'])}   WAL {bs.times(rr['wal_vs_classic'])}"
              f"   steady {bs.times(rr['steady_vs_classic'])}"
              + (f"   async worker / worker {bs.times(rr['async_vs_worker'])}" if rr["async_vs_worker"] else ""))
        for name, pr in rr["cycles_vs_worker"].items():
            print(f"          {name} / {'async_worker' if name.startswith('async_') else 'worker'} of the same "
                  f"round: median {bs.times(pr['median'])}, each {' '.join(f'{x:.3f}' for x in pr['each'])}")
    print_waits(results)
    print_threads(results)
    bs.print_targets(summary["targets"], "worker drain")


def print_threads(results: list[dict[str, Any]]) -> None:
    """The worker drains' client CPU per job by thread group (:func:`cpu_by_thread`),
    medians over the rounds per system and phase; the benchmark's own threads (its
    sampler, the pinning session) are in ``MainThread`` and ``other``."""
    by: dict[str, list[dict[str, float]]] = {}
    for r in results:
        if r.get("client_cpu_by_thread"):
            by.setdefault(f"{r['system']}/{r['phase']}", []).append(r["client_cpu_by_thread"])
    if not by:
        return
    groups = sorted({g for rs in by.values() for r in rs for g in r},
                    key=lambda g: -max(r.get(g, 0.0) for rs in by.values() for r in rs))
    print("\nClient CPU per job by thread (µs, /proc schedstat, medians over the rounds):")
    print(format_table(["system/phase", *groups],
                       [[k, *(f"{median([r.get(g, 0.0) for r in rs]) or 0.0:.1f}" for g in groups)]
                        for k, rs in by.items()]))


def print_waits(results: list[dict[str, Any]]) -> None:
    """With ``--wait-states``: what each drain's backends were doing (``WaitSampler``), as
    the mean number of the database's backends in each state over the drain, the medians
    over the rounds per system and phase."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        w = r["server"].get("waits")
        if w:
            by.setdefault(f"{r['system']}/{r['phase']}", []).append(w["mean_backends"])
    if not by:
        return
    print("\nThe database's backends during each drain, by state (mean number of backends over "
          "5 ms samples, medians over the rounds; sampling costs CPU: take no rates from this run):")
    print(format_table(["system/phase", *WAIT_STATES, "all"],
                       [[k, *(f"{median([x[c] for x in ws]) or 0.0:.2f}" for c in WAIT_STATES),
                         f"{median([sum(x.values()) for x in ws]) or 0.0:.2f}"] for k, ws in by.items()]))


def print_accounting(results: list[dict[str, Any]]) -> None:
    print("\nAccounting run (clean, every connection traced; not timed):")
    rows = []
    for r in results:
        m = r["messages_per_job"]
        rows.append([r["system"], r["drain"]["jobs"], f"{r['round_trips_per_job']:.3f}",
                     f"{m.get('Bind', 0.0):.3f}", f"{m.get('Query', 0.0):.3f}",
                     bs.fmt(r["drain"].get("wal_db_bytes_per_job")),
                     bs.fmt(r["drain"].get("server_cpu_us_per_job"), ".0f")])
    print(format_table(["system", "jobs", "round trips/job", "Bind/job", "Query/job",
                        "its DB's WAL B/job", "server CPU µs/job"], rows))
    for r in results:
        wal = r.get("wal_by_relation")
        if not wal:
            continue
        n = max(r["drain"]["jobs"], 1)
        print(f"\n  WAL of {r['system']} per job, by relation and record type (bytes / records):")
        for rel, e in sorted(wal["by_record"].items(), key=lambda kv: -kv[1]["bytes"])[:18]:
            print(f"    {rel:<76} {e['bytes'] / n:8.1f} B  {e['records'] / n:6.2f} rec"
                  + (f"  (FPI {e['fpi_bytes'] / n:.1f} B)" if e["fpi_bytes"] else ""))


# -- pickup -----------------------------------------------------------------------------------
class TaskRuns:
    """Every run of the worker's maintenance tasks during a pickup phase, collected from
    :meth:`Maintainer.reports` (which keeps only the latest runs per task) every 0.2 s."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker  # its maintainer is read when collecting (an AsyncWorker makes it at start)
        self.runs: dict[tuple[str, float], float] = {}  # (task, started) -> duration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-task-runs", daemon=True)

    def _collect(self) -> None:
        maintainer = self.worker.maintainer
        if maintainer is not None:
            for r in maintainer.reports():
                self.runs[(r.task, r.started)] = r.duration

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self._collect()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._collect()


def tail_overlap(runs: TaskRuns, pickups: list[tuple[float, float]], tail: float = 0.05) -> dict[str, Any]:
    """Per maintenance task: how many runs, their median length, and the share of all
    pickups and of the slowest ``tail`` of them whose wait (enqueue commit → handler start,
    on ``time.perf_counter``) overlapped at least one run. A task the tail overlaps far more
    often than the rest is part of the tail."""
    shift = time.perf_counter() - time.monotonic()  # the same clock on Linux; kept exact anyway
    by_task: dict[str, list[tuple[float, float]]] = {}
    for (task, started), duration in runs.runs.items():
        by_task.setdefault(task, []).append((started + shift, started + shift + duration))
    ordered = sorted(pickups, key=lambda p: p[1] - p[0])
    slowest = ordered[int(len(ordered) * (1 - tail)):]

    def share(group: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
        # the runs of one task follow each other, so the last run that began before a
        # pickup ended is the only one that can still have been going when it started
        starts = [s for s, _ in spans]
        hit = 0
        for a, b in group:
            i = bisect.bisect_right(starts, b) - 1
            hit += i >= 0 and spans[i][1] >= a
        return hit / len(group) if group else 0.0

    out = {}
    for task, spans in sorted(by_task.items()):
        spans.sort()
        lengths = sorted(e - s for s, e in spans)
        out[task] = {"runs": len(spans), "run_p50_ms": lengths[len(lengths) // 2] * 1000,
                     "all_share": share(ordered, spans), "tail_share": share(slowest, spans)}
    return out


def schedule_setting(text: str) -> tuple[str, float | int]:
    """``FIELD=VALUE`` of ``--schedule``: an int for a field whose default is an int."""
    name, _, value = text.partition("=")
    default = getattr(MaintenanceSchedule(), name, None)
    if default is None or not value:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with a MaintenanceSchedule field, got {text!r}")
    return name, int(value) if isinstance(default, int) else float(value)


class Errors:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def note(self, exc: Exception) -> None:
        key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1


def pickup_figures(system: str, phase: str, rate: float, schedule: PacedSchedule,
                   recorder: Recorder, errors: dict[str, int], dead: dict[str, Any]) -> dict[str, Any]:
    m = schedule.measured(recorder.started)
    achieved = len(m.jobs) / m.producer_seconds if m.producer_seconds else 0.0
    problems = []
    if m.missing:
        problems.append(f"{m.missing} enqueued jobs never picked up")
    if recorder.duplicates:
        problems.append(f"{recorder.duplicates} jobs picked up twice")
    return {
        "system": system, "phase": phase, "offered_rate": rate, "achieved_rate": achieved,
        "holds_rate": achieved >= HOLDS_RATE * rate, "enqueued": len(m.jobs),
        "pickup_ms": latency_summary(m.latencies), "enqueue_call_ms": latency_summary(m.enqueue_seconds),
        "producer_lag_ms": latency_summary(m.lag_seconds), "errors": errors,
        "dead_total": sum(f["dead"] for f in dead.values()), "problems": problems,
    }


class ClaimTrips:
    """When the claim that returned each job was sent and when it came back (by the job's
    ``n``), to split each pickup into three parts that add up to it: the wait for a claim
    (from the commit until a claim that returned the job was on its way, 0 when one was in
    flight already), that claim's round trip from then on, and the hand-off from its
    return to the handler's start."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_job: dict[int, tuple[float, float]] = {}

    def note(self, sent: float, returned: float, jobs: Iterable[int]) -> None:
        with self.lock:
            for n in jobs:
                self.by_job[n] = (sent, returned)

    def split(self, commit_at: dict[int, float], started: dict[int, float], jobs: Sequence[int]) -> dict[str, Any]:
        """The three parts' summaries (ms) over ``jobs`` (the measured window's)."""
        wait, trip, handoff = [], [], []
        for n in jobs:
            at, began, claim = commit_at[n], started.get(n), self.by_job.get(n)
            if began is None or claim is None:
                continue
            sent, returned = claim
            on_its_way = max(sent, at)
            wait.append(on_its_way - at)
            trip.append(returned - on_its_way)
            handoff.append(began - returned)
        return {"claim_wait_ms": latency_summary(wait), "claim_trip_ms": latency_summary(trip),
                "handoff_ms": latency_summary(handoff)}


#: The storage operations a worker claims through (by the same names on the asyncio face).
CLAIM_OPERATIONS = ("complete_and_claim", "claim_runtime_batch", "claim_runtime_batch_with_aging",
                    "claim_runtime_batch_with_aging_for_instance")


@contextmanager
def timed_claims(storage: Any, trips: ClaimTrips) -> Iterator[None]:
    """Note in ``trips`` when each claim of ``storage``'s claim operations was sent and came
    back, for the jobs it returned (their ``n``), until the block ends: the instance's bound
    operations are wrapped for the block and put back after it. ``storage`` is a
    :class:`QueueStorage` or an app's asyncio face (``App.async_storage``), whose calls
    return awaitables: those are timed until they are awaited to their end."""
    bound = {name: getattr(storage, name) for name in CLAIM_OPERATIONS}

    def noted(sent: float, result: Any) -> Any:
        jobs = result.claimed if isinstance(result, CompletedAndClaimed) else result
        trips.note(sent, time.perf_counter(), (int(j.job.args["n"]) for j in jobs))
        return result

    async def awaited(sent: float, pending: Awaitable[Any]) -> Any:
        return noted(sent, await pending)

    def timed(call: Callable[..., Any]) -> Callable[..., Any]:
        def claim(*args: Any, **kwargs: Any) -> Any:
            sent = time.perf_counter()
            result = call(*args, **kwargs)
            return awaited(sent, result) if inspect.isawaitable(result) else noted(sent, result)
        return claim

    for name, call in bound.items():
        storage.__dict__[name] = timed(call)
    try:
        yield
    finally:
        storage.__dict__.update(bound)


def worker_pickup(engine: Engine, qsys: bs.QstoreSystem, phase: str, rate: float,
                  args: argparse.Namespace, exact: bool, *, is_async: bool = False,
                  cycles: int | None = None) -> dict[str, Any]:
    recorder = Recorder()
    app, task = make_app(qsys, recorder, is_async=is_async)
    qsys.fresh(engine)
    checkpoint(engine)
    worker = new_worker(app, engine, args, is_async=is_async, cycles=cycles)
    errors = Errors()

    def defer_one(i: int) -> int:
        return int(task.defer(engine, n=i, payload="x" * 16))

    schedule = PacedSchedule(rate=rate, seconds=args.duration, warmup=args.warmup,
                             enqueue_one=defer_one, producers=args.producers, on_error=errors.note)
    runs = TaskRuns(worker)
    trips = ClaimTrips()
    timing = timed_claims(app.async_storage if is_async else qsys.storage, trips)
    with pinned(engine, phase == "pinned"), timing:
        worker.start()
        runs.start()
        try:
            schedule.run()
            schedule.settle(recorder.started, recorder.lock, 30.0)
        finally:
            worker.stop(timeout=30.0)
            runs.stop()
        dead = dead_tuples(engine, qsys.schema, exact)
    res = pickup_figures(worker_name(is_async, cycles, args), phase, rate, schedule, recorder,
                         errors.counts, dead)
    res["claims_in_flight"] = cycles
    m = schedule.measured(recorder.started)
    res["split"] = trips.split(schedule.commit_at, recorder.started, m.jobs)
    pickups = [(schedule.commit_at[i], recorder.started[i]) for i in m.jobs if i in recorder.started]
    res["stats"] = st = stats_of(worker)
    handled = max(len(recorder.started), 1)
    # the worker's own round trips for its jobs: claims (with the completions they took
    # along) and the batcher's completion calls
    res["calls_per_job"] = {
        "claims": st["claim_calls"] / handled, "empty_claims": st["empty_claims"] / handled,
        "completions_alone": (st["completion_calls"] - st["claims_with_completions"]) / handled,
        "round_trips": (st["claim_calls"] + st["completion_calls"] - st["claims_with_completions"]) / handled,
    }
    res["tail_overlap"] = tail_overlap(runs, pickups)
    return res


def classic_pickup(engine: Engine, csys: bs.ClassicSystem, phase: str, rate: float,
                   args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    """The SQLAlchemy classic queue: ``--concurrency`` threads woken by LISTEN/NOTIFY
    (``_benchlib.paced_pickup``), claim 10, complete the batch."""
    csys.fresh(engine, notify=True)
    checkpoint(engine)
    with Waker(engine, csys.notify_channel, args.concurrency) as waker, \
            pinned(engine, phase == "pinned"):
        p = paced_pickup(rate=rate, seconds=args.duration, warmup=args.warmup,
                         workers=args.concurrency, batch=CLASSIC_BATCH,
                         enqueue_one=lambda i: csys.enqueue_one(engine, i),
                         claim=lambda: csys.claim(engine, CLASSIC_BATCH),
                         complete=lambda got: csys.complete(engine, got), seq_of=csys.seq_of,
                         waker=waker, poll_interval=args.poll_interval, producers=args.producers)
        dead = dead_tuples(engine, csys.schema, exact)
    figures = bs.steady_figures(p)
    problems = []
    if p.missing:
        problems.append(f"{p.missing} enqueued jobs never picked up")
    if p.duplicates:
        problems.append(f"{p.duplicates} jobs picked up twice")
    return {"system": "classic", "phase": phase, **figures,
            "dead_total": sum(f["dead"] for f in dead.values()), "problems": problems}


def pg_pickup(engine: Engine, cpg: ClassicPsycopg, phase: str, rate: float,
              args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    """The psycopg classic queue: producers on connections of their own (prepared INSERT
    with ``pg_notify``), its LISTEN-woken workers (``--concurrency``), claim 10."""
    cpg.create()
    checkpoint(engine)
    recorder = Recorder()
    errors = Errors()
    local = threading.local()
    producers: list[Any] = []
    lock = threading.Lock()

    def enqueue_one(i: int) -> int:
        prod = getattr(local, "producer", None)
        if prod is None:
            prod = local.producer = cpg.producer()
            with lock:
                producers.append(prod)
        return prod.enqueue(bs.QUEUE, bs.KIND, bs.PRIORITY, {"n": i, "payload": "x" * 16})

    schedule = PacedSchedule(rate=rate, seconds=args.duration, warmup=args.warmup,
                             enqueue_one=enqueue_one, producers=args.producers, on_error=errors.note)
    trips = ClaimTrips()

    def claimed(sent: float, returned: float, rows: list[Row]) -> None:
        trips.note(sent, returned, (int(r[3]["n"]) for r in rows))

    with pinned(engine, phase == "pinned"):
        workers = cpg.pickup_workers(bs.QUEUE, lambda row: recorder.note(int(row[3]["n"])),
                                     workers=args.concurrency, batch=CLASSIC_BATCH,
                                     poll_interval=args.poll_interval, on_claim=claimed)
        try:
            schedule.run()
            schedule.settle(recorder.started, recorder.lock, 30.0)
        finally:
            workers.stop()
            for prod in producers:
                prod.close()
        dead = dead_tuples(engine, cpg.schema, exact)
    res = pickup_figures("classic_pg", phase, rate, schedule, recorder, errors.counts, dead)
    res["split"] = trips.split(schedule.commit_at, recorder.started, schedule.measured(recorder.started).jobs)
    res["errors"] = {**errors.counts, **workers.errors}
    res["claim_calls"], res["empty_claims"] = workers.claim_calls, workers.empty_claims
    res["wakes_notify"], res["wakes_poll"] = workers.wakes_notify, workers.wakes_poll
    return res


def run_pickup(engine: Engine, args: argparse.Namespace, exact: bool) -> list[dict[str, Any]]:
    sy = Systems(args)
    plan: list[tuple[str, Callable[[str, float], dict[str, Any]]]] = []
    if "classic" in sy.classics:
        plan.append(("classic", lambda p, r: classic_pickup(engine, sy.csys, p, r, args, exact)))
    if "classic_pg" in sy.classics:
        plan.append(("classic_pg", lambda p, r: pg_pickup(engine, sy.cpg, p, r, args, exact)))
    results = []
    try:
        for rnd in range(1, args.rounds + 1):
            workers: list[tuple[str, Callable[[str, float], dict[str, Any]]]] = []
            for is_async in (False, True) if args.run_async else (False,):
                for c in worker_variants(args, rnd):
                    workers.append((worker_name(is_async, c, args), functools.partial(
                        pickup_run, engine, sy.qsys, args, exact, is_async, c)))
            for rate in args.rates:
                for phase in args.phases:
                    for label, fn in plan + workers:
                        print(f"... pickup round {rnd}/{args.rounds}: {label} / {rate:g}/s / {phase}",
                              flush=True)
                        r = fn(phase, rate)
                        r["round"] = rnd
                        results.append(r)
                        pk = r["pickup_ms"]
                        print(f"    p50 {bs.fmt(pk['p50_ms'], '.2f')} p95 {bs.fmt(pk['p95_ms'], '.2f')} "
                              f"p99 {bs.fmt(pk['p99_ms'], '.2f')} ms, producer "
                              f"{r['achieved_rate']:,.0f}/{rate:,.0f}", flush=True)
    finally:
        sy.drop(engine)
    return results


def pickup_run(engine: Engine, qsys: bs.QstoreSystem, args: argparse.Namespace, exact: bool, is_async: bool,
               cycles: int | None, phase: str, rate: float) -> dict[str, Any]:
    return worker_pickup(engine, qsys, phase, rate, args, exact, is_async=is_async, cycles=cycles)


#: The parts of a pickup :class:`ClaimTrips` splits it into.
SPLIT_PARTS = ("claim_wait", "claim_trip", "handoff")


def summarise_pickup(results: list[dict[str, Any]], classics: list[str]) -> dict[str, Any]:
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["system"], r["offered_rate"], r["phase"]), []).append(r)
    med = {}
    for (system, rate, phase), rs in groups.items():
        med[f"{system}/{rate:g}/{phase}"] = {
            "rounds": len(rs),
            **{f"{q}_ms": median([r["pickup_ms"][f"{q}_ms"] for r in rs if r["pickup_ms"][f"{q}_ms"] is not None])
               for q in ("p50", "p95", "p99")},
            "holds_rate": all(r["holds_rate"] for r in rs),
            "achieved_rate": median([r["achieved_rate"] for r in rs]),
            "round_trips_per_job": median([r["calls_per_job"]["round_trips"] for r in rs])
            if all("calls_per_job" in r for r in rs) else None,
            **({f"{part}_{q}_ms": median([r["split"][f"{part}_ms"][f"{q}_ms"] for r in rs])
                for part in SPLIT_PARTS for q in ("p50", "p95")}
               if all("split" in r and r["split"]["claim_trip_ms"]["n"] for r in rs) else {}),
        }
    targets: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, Any]] = {}
    for rate in sorted({r["offered_rate"] for r in results}):
        for phase in PHASES:
            w = med.get(f"worker/{rate:g}/{phase}")
            if w is None:
                continue
            cl = [(med[k]["p95_ms"], c) for c in classics
                  if (k := f"{c}/{rate:g}/{phase}") in med and med[k]["p95_ms"] is not None]
            best = min(cl) if cl else None
            rr = bs.ratio(w["p95_ms"], best[0]) if best else None
            aw = med.get(f"async_worker/{rate:g}/{phase}")
            ratios[f"{rate:g}/{phase}"] = {"better_classic": best[1] if best else None,
                                           "worker_p95_ms": w["p95_ms"],
                                           "classic_p95_ms": best[0] if best else None,
                                           "p95_vs_classic": rr,
                                           "async_worker_p95_ms": aw["p95_ms"] if aw else None,
                                           "async_p95_vs_worker": bs.ratio(aw["p95_ms"], w["p95_ms"])
                                           if aw else None}
            v = verdict(rr, "<=", TARGETS["pickup_p95_vs_classic"],
                        None if w["holds_rate"] else f"producer reached {w['achieved_rate']:,.0f}/s")
            if not w["holds_rate"]:
                v["result"] = "FAIL"
            targets[f"pickup_p95_vs_classic_{rate:g}_{phase}"] = v
            if rate == 500:
                key = f"{phase}_pickup_p95_ms"
                v = verdict(w["p95_ms"], "<=", TARGETS[key])
                if not w["holds_rate"]:
                    v["result"] = "FAIL"
                targets[key] = v
    return {"medians": med, "ratios": ratios, "targets": targets}


def print_pickup(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = [[r["system"], f"{r['offered_rate']:g}", r["phase"], r["round"],
             f"{r['achieved_rate']:,.0f}", "yes" if r["holds_rate"] else "NO", r["enqueued"],
             bs.fmt(r["pickup_ms"]["p50_ms"], ".2f"), bs.fmt(r["pickup_ms"]["p95_ms"], ".2f"),
             bs.fmt(r["pickup_ms"]["p99_ms"], ".2f"), bs.fmt(r["enqueue_call_ms"]["p50_ms"], ".2f"),
             sum(r["errors"].values()), bs.fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok"]
            for r in results]
    print()
    print(format_table(["system", "rate", "phase", "round", "achieved j/s", "holds", "jobs",
                        "pickup p50 ms", "p95", "p99", "enqueue p50 ms", "errors", "dead", "check"], rows))
    print("\nPickup p95, worker / the lower classic p95 (medians over the rounds):")
    for key, rr in summary["ratios"].items():
        print(f"  {key:<14} worker {bs.fmt(rr['worker_p95_ms'], '.2f')} ms, {rr['better_classic']} "
              f"{bs.fmt(rr['classic_p95_ms'], '.2f')} ms: {bs.times(rr['p95_vs_classic'])}"
              + (f"; async worker {bs.fmt(rr['async_worker_p95_ms'], '.2f')} ms "
                 f"({bs.times(rr['async_p95_vs_worker'])} the worker's)"
                 if rr["async_worker_p95_ms"] is not None else ""))
    bs.print_targets(summary["targets"], "worker pickup")
    rows = [[r["system"], f"{r['offered_rate']:g}", r["phase"], r["round"],
             f"{r['calls_per_job']['round_trips']:.3f}", f"{r['calls_per_job']['claims']:.3f}",
             f"{r['calls_per_job']['empty_claims']:.3f}", f"{r['calls_per_job']['completions_alone']:.3f}"]
            for r in results if "calls_per_job" in r]
    med = summary["medians"]
    for key, m in med.items():
        system, rate, phase = key.split("/")
        base = med.get(f"{'async_worker' if system.startswith('async_') else 'worker'}/{rate}/{phase}")
        if "worker_c" in system and base is not None:
            print(f"  {system} {rate}/s {phase}: p95 {bs.fmt(m['p95_ms'], '.2f')} ms against "
                  f"{bs.fmt(base['p95_ms'], '.2f')} ms ({bs.times(bs.ratio(m['p95_ms'], base['p95_ms']))}), "
                  f"round trips/job {bs.fmt(m['round_trips_per_job'], '.3f')} against "
                  f"{bs.fmt(base['round_trips_per_job'], '.3f')} (medians)")
    split_rows = [[r["system"], f"{r['offered_rate']:g}", r["phase"], r["round"],
                   *(bs.fmt(part[f"{q}_ms"], ".2f")
                     for part in (r["pickup_ms"], *(r["split"][f"{p}_ms"] for p in SPLIT_PARTS))
                     for q in ("p50", "p95"))]
                  for r in results if "split" in r]
    if split_rows:
        print("\nWhere the pickups' time went, job by job (ms; the parts add up to each pickup): the "
              "wait for a claim that returned the job (0 when one was in flight), that claim's round "
              "trip from then on, the hand-off from its return to the handler:")
        print(format_table(["system", "rate", "phase", "round", "pickup p50", "p95", "wait p50", "p95",
                            "claim trip p50", "p95", "hand-off p50", "p95"], split_rows))
    print("\nThe workers' claim and completion calls per job picked up:")
    print(format_table(["system", "rate", "phase", "round", "round trips/job", "claims/job", "empty claims/job",
                        "completion calls alone/job"], rows))
    rows = [[r["phase"], f"{r['offered_rate']:g}", task, o["runs"], f"{o['run_p50_ms']:.1f}",
             f"{o['all_share']:.1%}", f"{o['tail_share']:.1%}"]
            for r in results if "tail_overlap" in r for task, o in r["tail_overlap"].items()]
    if rows:
        print("\nMaintenance runs the worker's pickups overlapped (all pickups vs the slowest 5%):")
        print(format_table(["phase", "rate", "task", "runs", "run p50 ms", "of all pickups",
                            "of slowest 5%"], rows))


# -- single enqueue ---------------------------------------------------------------------------
def job_args(i: int) -> dict[str, Any]:
    return {"n": i, "payload": "x" * 16}


def pg_enqueue(prod: Any, i: int) -> int:
    return int(prod.enqueue(bs.QUEUE, bs.KIND, bs.PRIORITY, job_args(i)))


def defer_one(task: Any, engine: Engine, i: int) -> int:
    return int(task.defer(engine, **job_args(i)))


def run_enqueue(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One thread enqueues single jobs back to back, each system in turn (see the module
    docstring); the jobs are never claimed."""
    sy = Systems(args)
    results = []

    def timed(system: str, phase: str, fn: Callable[[int], object]) -> dict[str, Any]:
        cpu0 = time.process_time()
        with pinned(engine, phase == "pinned"):
            one = timed_single_enqueue(fn, args.enqueue_seconds)
        cpu = time.process_time() - cpu0
        one["client_cpu_us_per_job"] = cpu * 1e6 / max(one["jobs"] + 50, 1)
        return {"system": system, "phase": phase, "single_enqueue": one}

    try:
        for rnd in range(1, args.rounds + 1):
            for phase in args.phases:
                batch: list[dict[str, Any]] = []
                if "classic" in sy.classics:
                    sy.csys.fresh(engine, notify=True)
                    batch.append(timed("classic", phase, lambda i: sy.csys.enqueue_one(engine, i)))
                if "classic_pg" in sy.classics:
                    sy.cpg.create()
                    with sy.cpg.producer() as prod:
                        batch.append(timed("classic_pg", phase, functools.partial(pg_enqueue, prod)))
                _, task = make_app(sy.qsys, Recorder())
                sy.qsys.fresh(engine)
                batch.append(timed("defer", phase, functools.partial(defer_one, task, engine)))
                for r in batch:
                    r["round"] = rnd
                    one = r["single_enqueue"]
                    print(f"... enqueue round {rnd}: {r['system']:<10} / {phase:<6} {one['jobs_per_s']:,.0f} "
                          f"jobs/s, call p50 {one['call_ms']['p50_ms']:.2f} ms, client CPU "
                          f"{one['client_cpu_us_per_job']:.0f} us/job", flush=True)
                results += batch
    finally:
        sy.drop(engine)
    return results


def summarise_enqueue(results: list[dict[str, Any]], classics: list[str]) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["system"], r["phase"]), []).append(r)
    med = {f"{s}/{p}": {"rounds": len(rs),
                        "jobs_per_s": median([r["single_enqueue"]["jobs_per_s"] for r in rs]),
                        "call_p50_ms": median([r["single_enqueue"]["call_ms"]["p50_ms"] for r in rs]),
                        "client_cpu_us_per_job": median([r["single_enqueue"]["client_cpu_us_per_job"]
                                                         for r in rs])}
           for (s, p), rs in groups.items()}
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for phase in PHASES:
        d = med.get(f"defer/{phase}")
        cl = [(med[k]["jobs_per_s"], c) for c in classics if (k := f"{c}/{phase}") in med]
        if d is None or not cl:
            continue
        best = max(cl)
        rr = bs.ratio(d["jobs_per_s"], best[0])
        # the median call is steadier than the rate on a shared host (a rate is its mean)
        by_p50 = bs.ratio(med[f"{best[1]}/{phase}"]["call_p50_ms"], d["call_p50_ms"])
        ratios[phase] = {"better_classic": best[1], "defer_vs_classic": rr,
                         "defer_vs_classic_by_call_p50": by_p50}
        targets[f"{phase}_defer_vs_classic"] = verdict(rr, ">=", TARGETS["defer_vs_classic"])
    return {"medians": med, "ratios": ratios, "targets": targets}


def print_enqueue(summary: dict[str, Any]) -> None:
    print("\nSingle enqueue, one thread (medians over the rounds):")
    print(format_table(["system/phase", "rounds", "jobs/s", "call p50 ms", "client CPU µs/job"],
                       [[k, m["rounds"], bs.fmt(m["jobs_per_s"]), bs.fmt(m["call_p50_ms"], ".2f"),
                         bs.fmt(m["client_cpu_us_per_job"], ".0f")] for k, m in summary["medians"].items()]))
    for phase, rr in summary["ratios"].items():
        print(f"  {phase:<6} defer / {rr['better_classic']}: {bs.times(rr['defer_vs_classic'])} "
              f"(by the median call: {bs.times(rr['defer_vs_classic_by_call_p50'])})")
    bs.print_targets(summary["targets"], "single defer")


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--phases", default=",".join(PHASES), type=lambda s: s.split(","))
    p.add_argument("--classics", default=",".join(CLASSICS), type=lambda s: s.split(","),
                   help="the classic queues to run beside qstore: sqlalchemy, psycopg or both")
    p.add_argument("--classic-pg-driver", choices=("threads", "asyncio"), default="threads",
                   help="how the psycopg classic queue runs its workers")
    p.add_argument("--skip-storage", action="store_true", help="drain: no storage-level loop")
    p.add_argument("--claims-in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="drain and pickup: run the worker with each of these claims_in_flight values "
                        "(comma-separated; the first is the run's worker, the others worker_cN)")
    p.add_argument("--load-lanes", type=int, default=1,
                   help="drain: load the worker's jobs in this many COPY calls, each into the next "
                        "of the queue's lanes (default 1: one COPY, one lane)")
    p.add_argument("--prefetch", type=int, default=None,
                   help="drain and pickup: the workers' prefetch (default: the setting's default)")
    p.add_argument("--claim-batch", type=int, default=None,
                   help="drain and pickup: the workers' claim_batch (default: the setting's default)")
    p.add_argument("--claim-ahead", type=int, default=None,
                   help="drain and pickup: the workers' claim_ahead (default: the setting's default; "
                        "0 turns claiming ahead off)")
    p.add_argument("--async", dest="run_async", action="store_true",
                   help="drain and pickup: also the AsyncWorker (async def no-op task), after the worker")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[500.0, 2000.0],
                   help="pickup: offered rates, jobs/s (comma-separated)")
    p.add_argument("--rate", dest="rates", type=lambda s: [float(s)],
                   help="pickup: one offered rate (same as --rates with one value)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="pickup: the classic workers' polling fallback (seconds)")
    p.add_argument("--enqueue-seconds", type=float, default=5.0)
    p.add_argument("--account-jobs", type=int, default=5_000,
                   help="drain: jobs of the traced accounting run per system (0: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a drain may take")
    p.add_argument("--qstore-schema", default="bench_worker_qstore")
    p.add_argument("--classic-schema", default="bench_worker_classic")
    p.add_argument("--classic-pg-schema", default="bench_worker_classic_pg")
    p.add_argument("--app-pool", choices=("sized", "default"), default="sized",
                   help="the run's engine (the producers' and the one the worker is given): a pool "
                        "sized for the run's threads, or SQLAlchemy's default pool (5 kept, 10 more), "
                        "as an application's first engine has")
    p.add_argument("--shared-pool", action="store_true",
                   help="drain and pickup: the workers use the run's engine's pool (own_pool=False) "
                        "instead of a pool of their own made from it")
    p.add_argument("--wait-states", action="store_true",
                   help="drain: sample what the database's backends are doing every 5 ms (costs CPU; "
                        "not for rates)")
    p.add_argument("--json", type=Path)
    p.add_argument("--schedule", type=schedule_setting, action="append", default=[], metavar="FIELD=VALUE",
                   help="a MaintenanceSchedule field of the worker's maintainer (repeatable), e.g. "
                        "claim_ring_turn_bytes=0")
    args = p.parse_args(argv)
    args.schedule = MaintenanceSchedule(**dict(args.schedule)) if args.schedule else None
    if any(c not in CLASSICS for c in args.classics):
        p.error(f"--classics must name some of {', '.join(CLASSICS)}")
    if any(c < 1 for c in args.claims_in_flight) or len(set(args.claims_in_flight)) != len(args.claims_in_flight):
        p.error("--claims-in-flight takes distinct values >= 1")
    if any(x not in PHASES for x in args.phases):
        p.error(f"--phases must be a subset of {','.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.url)
    engine = (make_engine(args.url, args.concurrency + args.producers + 4) if args.app_pool == "sized"
              else create_engine(args.url))
    exact = ensure_pgstattuple(engine)
    info = server_info(engine)
    pg = info["postgres"]
    classics = [CLASSICS[c] for c in args.classics]
    print(f"bench_worker: {args.jobs:,} jobs, concurrency {args.concurrency}, classics "
          f"{', '.join(classics)}, PostgreSQL {pg['server_version']}, autovacuum {pg['autovacuum']}, "
          f"{info['cpus']} CPUs, {args.app_pool} engine pool"
          f"{', shared by the workers' if args.shared_pool else ''}")
    payload: dict[str, Any] = {
        "command": " ".join(["python", "scripts/bench_worker.py", *(argv or sys.argv[1:])]),
        "machine": info, "config": {k: str(v) for k, v in vars(args).items() if k != "url"},
    }
    problems: list[str] = []
    try:
        if args.mode in ("drain", "all"):
            drained = run_drain(engine, args, exact)
            summary = summarise_drain(drained, args.jobs, classics)
            print_drain(drained, summary)
            payload["drain"] = {"results": drained, "summary": summary}
            problems += [f"drain {r['system']}/{r['phase']}: {p}" for r in drained for p in r["problems"]]
            if args.account_jobs > 0:
                accounted = run_accounting(engine, args, exact)
                print_accounting(accounted)
                payload["drain"]["accounting"] = accounted
                problems += [f"accounting {r['system']}: {p}" for r in accounted for p in r["problems"]]
        if args.mode in ("pickup", "all"):
            picked = run_pickup(engine, args, exact)
            summary = summarise_pickup(picked, classics)
            print_pickup(picked, summary)
            payload["pickup"] = {"results": picked, "summary": summary}
            problems += [f"pickup {r['system']}/{r['offered_rate']:g}/{r['phase']}: {p}"
                         for r in picked for p in r["problems"]]
        if args.mode in ("enqueue", "all"):
            enq = run_enqueue(engine, args)
            summary = summarise_enqueue(enq, classics)
            print_enqueue(summary)
            payload["enqueue"] = {"results": enq, "summary": summary}
    finally:
        engine.dispose()
    payload["problems"] = problems
    return finish(args.json, payload, problems)


if __name__ == "__main__":
    raise SystemExit(main())
