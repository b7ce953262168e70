"""The demo's steady run: qstore and a classic queue side by side while the horizon is pinned.

Two systems run at once on one server, each in a schema of its own:

* **qstore**: a :class:`~qstore.runtime.worker.Worker` with its default settings (its
  maintainer inside) over the install in ``--schema``;
* **classic**: the one-table ``SKIP LOCKED`` queue of :mod:`qstore.cli.demo_classic`, with
  16 worker threads claiming 10 jobs at a time.

The tables whose rows are deleted or updated, the classic ``jobs`` table and qstore's
deferred backlog (where delayed, retried and snoozed jobs wait until due), are vacuumed every
:data:`VACUUM_EVERY` seconds, as an aggressively tuned autovacuum would (whatever the server's
``autovacuum`` setting).

A producer per system offers ``rate`` jobs/s, in one statement every :data:`TICK` seconds,
the same mix for both (:func:`outcome_for`): most complete, some raise once and are retried
after the backoff, some snooze once, a few fail for good, and a share is scheduled with a
delay. For the middle third of the run one more connection sits idle in a transaction that
holds an xid (the pin): no tuple deleted after it began can be removed by anyone.

Before the clock starts, each system runs a few plain jobs (connections opened, statements
prepared), then the producers run for a lead-in of :data:`LEAD_IN` seconds that no figure
counts. Once a second one connection reads, for both schemas in one statement, the dead tuples the
statistics count (``pg_stat_get_dead_tuples``: row versions deleted or updated and not yet
removed by vacuum or pruning; each session reports at most once a second) and the bytes of
every table and index (``pg_relation_size`` of each, a fifth of the cost of
``pg_total_relation_size`` per table); throughput comes from the
workers' own counters (jobs that reached a terminal state: completed, or failed for good),
and pickup latency from the handlers: from the commit of a job's enqueue (as the producer
sees it return) to the start of its first handler, for jobs enqueued ready.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

import psycopg
from psycopg import sql
from sqlalchemy import Engine

from qstore.cli.common import human_bytes, table_lines
from qstore.cli.demo_classic import ClassicJob, ClassicQueue, ClassicWorkers, Outcome
from qstore.runtime.tasks import App, Fail, JobContext, Snooze
from qstore.runtime.worker import Worker
from qstore.storage import QueueStorage
from qstore.types import InsertOpts, InsertParams

__all__ = ["DEFAULT_DURATION", "DEFAULT_RATE", "SAMPLE_SQL", "Progress", "SteadyResult", "outcome_for",
           "percentile", "plot_steady", "run_steady", "summary_lines"]

DEFAULT_DURATION = 15.0
DEFAULT_RATE = 500.0
WARMUP_JOBS = 20  # plain jobs each system runs before the clock starts (connections, statements)
WARMUP_LIMIT = 3.0  # seconds the warm-up may take at most
LEAD_IN = 2.0  # seconds of steady load before the clock starts (at most a sixth of the run)
TICK = 0.01
SAMPLE_EVERY = 1.0
VACUUM_EVERY = 2.0
RECENT = 3.0  # seconds of pickups behind the progress line's p95
SNOOZE_SECONDS = 1.0
DELAY_SECONDS = 2.0
QUEUE = "demo"
KIND = "demo.steady"
SYSTEMS = ("qstore", "classic")

#: Outcome of job ``i``, by ``i % 100``: 1 % fail for good, 2 % snooze once, 4 % raise once
#: (retried after the backoff), 10 % scheduled with a delay, the rest complete.
_MIX: tuple[tuple[range, str], ...] = (
    (range(0, 1), "fail"), (range(1, 3), "snooze"), (range(3, 7), "retry"), (range(7, 17), "delayed"))


def outcome_for(i: int) -> str:
    """What job number ``i`` does: ``ok``, ``retry``, ``snooze``, ``fail`` or ``delayed``."""
    for span, name in _MIX:
        if i % 100 in span:
            return name
    return "ok"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Pickups:
    """Enqueue commits and first handler starts of one system, matched by job id. A handler
    that starts before its producer saw the commit return is matched to the moment the
    enqueue was sent (the commit lies between the two)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed: dict[int, float] = {}
        self._early: dict[int, float] = {}
        self.seen: list[tuple[float, float]] = []  # (handler start, latency in seconds)

    def committed(self, ids: Sequence[int], sent: float, at: float) -> None:
        """The enqueue of ``ids``, sent at ``sent``, returned (committed) at ``at``."""
        with self._lock:
            for job_id in ids:
                started = self._early.pop(job_id, None)
                if started is None:
                    self._committed[job_id] = at
                else:
                    self.seen.append((started, max(0.0, started - sent)))

    def started(self, job_id: int, at: float) -> None:
        """The first handler of a ready job started at ``at``."""
        with self._lock:
            committed = self._committed.pop(job_id, None)
            if committed is None:
                self._early[job_id] = at
            else:
                self.seen.append((at, max(0.0, at - committed)))

    def since(self, start: float) -> list[float]:
        """Latencies of the pickups that started at ``start`` or later."""
        out = []
        with self._lock:
            for at, lat in reversed(self.seen):
                if at >= start:
                    out.append(lat)
                elif at < start - 1.0:  # the list is in start order within a second
                    break
        return out

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the pickups that started in ``[start, end)``."""
        with self._lock:
            return [lat for at, lat in self.seen if start <= at < end]


class _Mix:
    """The handler logic both systems share: what a job does on this run, and its pickup."""

    def __init__(self, pickups: Pickups) -> None:
        self.pickups = pickups
        self._snoozed: set[int] = set()
        self._lock = threading.Lock()

    def decide(self, job_id: int, outcome: str, attempt: int) -> str:
        """``complete``, ``retry``, ``snooze`` or ``fail``; notes the pickup of a ready job's
        first run."""
        now = time.monotonic()
        if outcome == "snooze":
            with self._lock:
                first = job_id not in self._snoozed
                self._snoozed.add(job_id)
        else:
            first = attempt == 1
        if first and outcome != "delayed":
            self.pickups.started(job_id, now)
        if outcome == "fail":
            return "fail"
        if outcome == "snooze" and first:
            return "snooze"
        if outcome == "retry" and first:
            return "retry"
        return "complete"


class _System:
    """One system of the run: its producer statement, its workers and its counters."""

    name: str
    schema: str

    def __init__(self) -> None:
        self.pickups = Pickups()
        self.mix = _Mix(self.pickups)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def terminal(self) -> int:
        """Jobs that reached a terminal state (completed, or failed for good) so far."""
        raise NotImplementedError

    def outcomes(self) -> dict[str, int]:
        raise NotImplementedError

    def errors(self) -> int:
        """Calls of its workers that failed (claims, outcome writes, completions)."""
        raise NotImplementedError

    def enqueue(self, first: int, n: int, *, plain: bool = False) -> None:
        """Enqueue jobs ``first .. first + n - 1`` of the mix in one statement (``plain``:
        jobs that just complete, for the warm-up)."""
        raise NotImplementedError


class _QstoreSystem(_System):
    name = "qstore"

    def __init__(self, storage: QueueStorage, engine: Engine) -> None:
        super().__init__()
        self.storage, self.engine = storage, engine
        self.schema = storage.schema()
        self.app = App(storage)
        mix = self.mix

        def steady(ctx: JobContext, o: str) -> Any:
            action = mix.decide(ctx.job_id, o, ctx.attempt)
            if action == "fail":
                return Fail("demo: this job fails for good")
            if action == "snooze":
                return Snooze(SNOOZE_SECONDS)
            if action == "retry":
                raise RuntimeError("demo: transient error, retried")
            return None

        self.app.task(kind=KIND, queue=QUEUE, max_attempts=3)(steady)
        self.worker = Worker(self.app, engine)  # the defaults: 16 handlers, its maintainer inside
        self._stopped: Any = None

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self._stopped = self.worker.stop(timeout=10)

    def _stats(self) -> Any:
        return self._stopped if self._stopped is not None else self.worker.stats

    def terminal(self) -> int:
        s = self._stats()
        return int(s.completed + s.failed)

    def outcomes(self) -> dict[str, int]:
        s = self._stats()
        return {"completed": s.completed, "retried": s.retried, "snoozed": s.snoozed, "failed": s.failed}

    def errors(self) -> int:
        s = self._stats()
        return int(s.claim_errors + s.outcome_errors)

    def enqueue(self, first: int, n: int, *, plain: bool = False) -> None:
        now = datetime.now(timezone.utc)
        later = now + timedelta(seconds=DELAY_SECONDS)
        names = ["ok"] * n if plain else [outcome_for(i) for i in range(first, first + n)]
        params = [InsertParams(KIND, {"o": o}, InsertOpts(queue=QUEUE, max_attempts=3,
                                                          run_at=later if o == "delayed" else None))
                  for o in names]
        sent = time.monotonic()
        ids = self.storage.enqueue_many(self.engine, params)
        at = time.monotonic()
        self.pickups.committed([i for i, o in zip(ids, names, strict=True) if o != "delayed"], sent, at)


class _ClassicSystem(_System):
    name = "classic"

    def __init__(self, queue: ClassicQueue) -> None:
        super().__init__()
        self.queue = queue
        self.schema = queue.schema
        mix = self.mix

        def handle(job: ClassicJob) -> Outcome:
            action = mix.decide(job.id, str(job.payload.get("o")), job.attempts)
            if action == "retry":
                return Outcome("retry", error="demo: transient error, retried")
            if action == "snooze":
                return Outcome("snooze", seconds=SNOOZE_SECONDS)
            if action == "fail":
                return Outcome("fail", error="demo: this job fails for good")
            return Outcome("complete")

        self.workers = ClassicWorkers(queue, handle, workers=16, batch=10, poll_interval=1.0)
        self._conn = queue.connect()

    def start(self) -> None:
        self.workers.start()

    def stop(self) -> None:
        self.workers.stop()
        self._conn.close()

    def terminal(self) -> int:
        return self.workers.terminal

    def outcomes(self) -> dict[str, int]:
        w = self.workers
        return {"completed": w.completed, "retried": w.retried, "snoozed": w.snoozed, "failed": w.failed}

    def errors(self) -> int:
        return sum(self.workers.errors.values())

    def enqueue(self, first: int, n: int, *, plain: bool = False) -> None:
        names = ["ok"] * n if plain else [outcome_for(i) for i in range(first, first + n)]
        sent = time.monotonic()
        rows = self.queue.enqueue(self._conn, KIND, [{"o": o} for o in names],
                                  [DELAY_SECONDS if o == "delayed" else 0.0 for o in names])
        at = time.monotonic()
        self.pickups.committed([i for i, due in rows if due], sent, at)


class _Producer(threading.Thread):
    """Offers ``rate`` jobs/s to one system: every ``TICK`` the jobs due by then, in one
    statement, until stopped. Errors are counted and the schedule goes on."""

    def __init__(self, system: _System, rate: float, t0: float, stop: threading.Event) -> None:
        super().__init__(name=f"demo-producer-{system.name}", daemon=True)
        self.system, self.rate, self.t0, self.halt = system, rate, t0, stop
        self.offered = 0
        self.errors = 0

    def run(self) -> None:
        next_at = self.t0
        while not self.halt.is_set():
            due = int((time.monotonic() - self.t0) * self.rate) - self.offered
            if due > 0:
                try:
                    self.system.enqueue(self.offered, due)
                except Exception:
                    self.errors += 1
                self.offered += due
            next_at += TICK
            wait = next_at - time.monotonic()
            if wait > 0:
                self.halt.wait(wait)
            else:
                next_at = time.monotonic()


class _Vacuum(threading.Thread):
    """``VACUUM`` of ``tables`` every :data:`VACUUM_EVERY` seconds: autovacuum's part, for the
    tables of both systems whose rows are deleted or updated (the classic ``jobs`` table and
    qstore's deferred backlog)."""

    def __init__(self, conninfo: str, tables: Sequence[sql.Composable], stop: threading.Event) -> None:
        super().__init__(name="demo-vacuum", daemon=True)
        self.conninfo, self.tables, self.halt = conninfo, list(tables), stop
        self.runs = 0

    def run(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            while not self.halt.wait(VACUUM_EVERY):
                for table in self.tables:
                    try:
                        conn.execute(sql.SQL("VACUUM {}").format(table))
                        self.runs += 1
                    except psycopg.Error:
                        pass


SAMPLE_SQL = (
    "SELECT n.nspname, "
    "coalesce(sum(pg_stat_get_dead_tuples(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::bigint, "
    "coalesce(sum(pg_relation_size(c.oid)), 0)::bigint "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'i') GROUP BY n.nspname")


@dataclass
class Point:
    """One sample of one system: seconds since the start, terminal jobs so far, dead tuples,
    bytes, and the pickup p95 of the last :data:`RECENT` seconds (None: no pickup)."""

    at: float
    terminal: int
    dead: int
    bytes: int
    p95: float | None
    phase: str


@dataclass
class SteadyResult:
    """What the run measured: per system its points, pickups and outcomes; the pin's window."""

    duration: float
    rate: float
    pin: tuple[float, float]
    points: dict[str, list[Point]] = field(default_factory=dict)
    pickups: dict[str, Pickups] = field(default_factory=dict)
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    offered: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # failed enqueues and worker calls
    marks: dict[str, dict[str, Point]] = field(default_factory=dict)  # pin_start / pin_end / end
    pinned_xid: int | None = None
    t0: float = 0.0  # the run's start on the monotonic clock the pickups are kept on


class Progress:
    """Two lines, one per system: redrawn in place on a terminal, else printed once a second."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        isatty = getattr(out, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.drawn = False

    def show(self, lines: Sequence[str]) -> None:
        if self.tty:
            if self.drawn:
                self.out.write(f"\x1b[{len(lines)}A")
            width = shutil.get_terminal_size().columns - 1  # a wrapped line would break the redraw
            for line in lines:
                self.out.write(f"\r\x1b[K{line[:width]}\n")
            self.drawn = True
        else:
            for line in lines:
                self.out.write(line + "\n")
        self.out.flush()

    def say(self, line: str) -> None:
        """A line of its own; on a terminal the next progress is drawn below it."""
        self.out.write(line + "\n")
        self.out.flush()
        self.drawn = False


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def _line(name: str, p: Point, prev: Point | None) -> str:
    prev_at, prev_n = (prev.at, prev.terminal) if prev else (0.0, 0)
    rate = (p.terminal - prev_n) / max(p.at - prev_at, 1e-9)
    return (f"{p.at:5.1f} s  {name:<7} {rate:>6,.0f} jobs/s  p95 {_ms(p.p95):>9}  "
            f"dead {p.dead:>7,}  {human_bytes(p.bytes):>8}  {p.phase}")


def run_steady(url: str, storage: QueueStorage, engine: Engine, classic: ClassicQueue, out: TextIO,
               *, duration: float = DEFAULT_DURATION, rate: float = DEFAULT_RATE) -> SteadyResult:
    """Run both systems for ``duration`` seconds at ``rate`` offered jobs/s each, the horizon
    pinned for the middle third, with live progress on ``out``; what was measured. The
    qstore schema must be installed and the classic table created."""
    systems: list[_System] = [_QstoreSystem(storage, engine), _ClassicSystem(classic)]
    pin_at, unpin_at = duration / 3, 2 * duration / 3
    result = SteadyResult(duration=duration, rate=rate, pin=(pin_at, unpin_at))
    for s in systems:
        result.points[s.name] = []
        result.pickups[s.name] = s.pickups
        result.marks[s.name] = {}
    progress = Progress(out)
    halt = threading.Event()
    conninfo = classic.conninfo
    sampler = psycopg.connect(conninfo, autocommit=True)
    pin: psycopg.Connection[Any] | None = None
    deferred = storage.tables.deferred.name
    vacuum = _Vacuum(conninfo, [sql.Identifier(classic.schema, "jobs"), sql.Identifier(storage.schema(), deferred)],
                     halt)
    producers: list[_Producer] = []
    lead: dict[str, int] = {}
    schemas = [s.schema for s in systems]
    try:
        for s in systems:
            s.start()
        vacuum.start()
        # warm-up: a few plain jobs through each system open its connections and prepare
        # its statements before the clock starts; the counts start after them
        for s in systems:
            s.enqueue(0, WARMUP_JOBS, plain=True)
        limit = time.monotonic() + WARMUP_LIMIT
        while any(s.terminal() < WARMUP_JOBS for s in systems) and time.monotonic() < limit:
            time.sleep(0.02)
        began = time.monotonic()
        producers = [_Producer(s, rate, began, halt) for s in systems]
        for p in producers:
            p.start()
        time.sleep(min(LEAD_IN, duration / 6))  # the load runs a moment before the clock starts
        base = {s.name: s.terminal() for s in systems}
        lead = {p.system.name: p.offered for p in producers}
        t0 = result.t0 = time.monotonic()

        def sample(phase: str) -> dict[str, Point]:
            now = time.monotonic()
            rows = {r[0]: (int(r[1]), int(r[2])) for r in sampler.execute(SAMPLE_SQL, (schemas,))}
            taken = {}
            for s in systems:
                dead, size = rows.get(s.schema, (0, 0))
                recent = s.pickups.since(max(t0, now - RECENT))
                taken[s.name] = Point(now - t0, s.terminal() - base[s.name], dead, size,
                                      percentile(recent, 0.95), phase)
            return taken

        def mark(name: str, taken: dict[str, Point]) -> None:
            for s in systems:
                result.marks[s.name][name] = taken[s.name]

        phase = "clean"
        next_sample = t0 + SAMPLE_EVERY
        events: list[tuple[float, str]] = [(t0 + pin_at, "pin"), (t0 + unpin_at, "unpin"), (t0 + duration, "end")]
        while True:
            at, what = min([(next_sample, "sample"), *events])
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if what == "sample":
                taken = sample(phase)
                lines = []
                for s in systems:
                    pts = result.points[s.name]
                    lines.append(_line(s.name, taken[s.name], pts[-1] if pts else None))
                    pts.append(taken[s.name])
                progress.show(lines)
                next_sample += SAMPLE_EVERY
                continue
            events.pop(0)
            if what == "pin":
                mark("pin_start", sample(phase))
                pin = psycopg.connect(conninfo, autocommit=False)
                row = pin.execute("SELECT txid_current()").fetchone()
                result.pinned_xid = int(row[0]) if row else None
                phase = "pinned"
                progress.say(f"{at - t0:5.1f} s  horizon pinned: a transaction holding xid "
                             f"{result.pinned_xid} sits idle: VACUUM can remove nothing deleted from now on")
            elif what == "unpin":
                mark("pin_end", sample(phase))
                if pin is not None:
                    pin.rollback()
                    pin.close()
                    pin = None
                phase = "after"
                progress.say(f"{at - t0:5.1f} s  horizon released")
            else:
                halt.set()
                mark("end", sample(phase))
                for s in systems:  # the last point of the plot
                    result.points[s.name].append(result.marks[s.name]["end"])
                break
    finally:
        halt.set()
        for p in producers:
            p.join(10)
        for s in systems:
            s.stop()
        vacuum.join(10)
        if pin is not None:
            pin.close()
        sampler.close()
    for s, p in zip(systems, producers, strict=False):
        result.outcomes[s.name] = s.outcomes()
        result.offered[s.name] = p.offered - lead.get(s.name, 0)
        result.errors[s.name] = s.errors() + p.errors
    return result


def _phase_rate(result: SteadyResult, name: str, start: str | None, end: str) -> float:
    marks = result.marks[name]
    a = marks[start] if start else None
    b = marks[end]
    t_a, n_a = (a.at, a.terminal) if a else (0.0, 0)
    return (b.terminal - n_a) / max(b.at - t_a, 1e-9)


def summary_lines(result: SteadyResult) -> list[str]:
    """The side-by-side table of both systems."""
    a, b = result.pin
    windows = {"before": (0.0, a), "during": (a, b), "after": (b, result.duration)}

    def p95(name: str, phase: str) -> str:
        lo, hi = windows[phase]
        return _ms(percentile(result.pickups[name].between(result.t0 + lo, result.t0 + hi), 0.95))

    rows: list[list[Any]] = []

    def row(label: str, fn: Callable[[str], Any]) -> None:
        rows.append([label, *(fn(n) for n in SYSTEMS)])

    row("jobs offered", lambda n: f"{result.offered[n]:,}")
    row("jobs done (completed or failed)", lambda n: f"{result.marks[n]['end'].terminal:,}")
    row("retried / snoozed / failed", lambda n: "{retried:,} / {snoozed:,} / {failed:,}".format(**result.outcomes[n]))
    row("jobs/s before the pin", lambda n: f"{_phase_rate(result, n, None, 'pin_start'):,.0f}")
    row("jobs/s during the pin", lambda n: f"{_phase_rate(result, n, 'pin_start', 'pin_end'):,.0f}")
    row("jobs/s after the pin", lambda n: f"{_phase_rate(result, n, 'pin_end', 'end'):,.0f}")
    row("pickup p95 before the pin", lambda n: p95(n, "before"))
    row("pickup p95 during the pin", lambda n: p95(n, "during"))
    row("pickup p95 after the pin", lambda n: p95(n, "after"))
    row("dead tuples at the end of the pin", lambda n: f"{result.marks[n]['pin_end'].dead:,}")
    row("dead tuples at the end", lambda n: f"{result.marks[n]['end'].dead:,}")
    row("bytes before the pin", lambda n: human_bytes(result.marks[n]["pin_start"].bytes))
    row("bytes at the end", lambda n: human_bytes(result.marks[n]["end"].bytes))
    if any(result.errors.values()):
        row("failed calls (enqueue, claim, outcome)", lambda n: f"{result.errors[n]:,}")
    return table_lines(["", *SYSTEMS], rows)


def plot_steady(result: SteadyResult, path: str, plt: Any) -> None:
    """Throughput, pickup p95, dead tuples and bytes of both systems over time into ``path``
    (a PNG), the pinned window shaded; ``plt`` is matplotlib's ``pyplot``."""
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(9, 10))
    colors = {"qstore": "tab:blue", "classic": "tab:red"}
    for name in SYSTEMS:
        pts = result.points[name]
        t = [p.at for p in pts]
        rates = [(b.terminal - a.terminal) / max(b.at - a.at, 1e-9)
                 for a, b in zip([Point(0.0, 0, 0, 0, None, "clean"), *pts[:-1]], pts, strict=True)]
        axes[0].plot(t, rates, label=name, color=colors[name])
        axes[1].plot(t, [float("nan") if p.p95 is None else p.p95 * 1000 for p in pts],
                     label=name, color=colors[name])
        axes[2].plot(t, [p.dead for p in pts], label=name, color=colors[name])
        axes[3].plot(t, [p.bytes / 2**20 for p in pts], label=name, color=colors[name])
    labels = ["jobs/s (completed or failed)", f"pickup p95, ms (last {RECENT:g} s)",
              "dead tuples", "table + index MB"]
    for ax, label in zip(axes, labels, strict=True):
        ax.axvspan(*result.pin, color="0.85", label="horizon pinned")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[1].set_ylim(bottom=0)
    axes[0].legend(loc="lower left")
    axes[0].set_title(f"qstore demo: {result.rate:,.0f} jobs/s offered to each, "
                      f"horizon pinned from {result.pin[0]:g} s to {result.pin[1]:g} s")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
